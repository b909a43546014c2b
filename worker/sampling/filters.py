"""Probability filters: min-p, then top-k, then top-p (vLLM's order), each zeroing the ids a
request drops.

They run on the sampler's probability grid (multiples of 2**-16, the top id at exactly 1), where
every comparison and running sum is exact: ranks holding the same logits keep the same ids. Each
filter keeps by a threshold on the values, so ids tied with the last one kept stay too, and the
result does not depend on how a sort orders equal values.
"""

import numpy as np
import torch


def filter_probabilities(
    probs: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> torch.Tensor:
    """`probs` [S, V] float64 on the grid with those of the dropped ids set to 0 (a new tensor
    where a row filters); the columns give each row's settings."""
    vocab_size = probs.shape[1]
    device = probs.device
    rows = np.flatnonzero(min_p > 0.0)
    if len(rows):
        selected = probs[rows]
        fraction = torch.from_numpy(min_p[rows]).to(device)
        probs = _keep_at_least(probs, rows, fraction * selected.amax(dim=-1))
    rows = np.flatnonzero(top_k < vocab_size)
    if len(rows):
        probs = _keep_at_least(probs, rows, _kth_largest(probs[rows], top_k[rows], device))
    rows = np.flatnonzero(top_p < 1.0)
    if len(rows):
        probs = _keep_at_least(probs, rows, _top_p_threshold(probs[rows], top_p[rows], device))
    return probs


def _kth_largest(probs: torch.Tensor, top_k: np.ndarray, device: torch.device) -> torch.Tensor:
    """Each row's k-th largest value [R]: keeping the values at or above it keeps k ids (more
    on a tie)."""
    largest = torch.topk(probs, int(top_k.max()), dim=-1).values  # [R, max k], descending
    kth = torch.from_numpy(top_k - 1).to(device)
    return largest.gather(1, kth[:, None])[:, 0]


def _top_p_threshold(probs: torch.Tensor, top_p: np.ndarray, device: torch.device) -> torch.Tensor:
    """The value [R] at which each row's descending running mass first reaches top_p of its
    total: the smallest set of that mass is the ids at or above it."""
    ordered = torch.sort(probs, dim=-1, descending=True).values  # [R, V]
    mass = torch.cumsum(ordered, dim=-1)  # exact on the grid
    needed = torch.from_numpy(top_p).to(device) * mass[:, -1]
    num_short = (mass < needed[:, None]).sum(dim=-1)  # entries before the mass is reached
    last = torch.clamp(num_short, max=probs.shape[1] - 1)
    return ordered.gather(1, last[:, None])[:, 0]


def _keep_at_least(probs: torch.Tensor, rows: np.ndarray, thresholds: torch.Tensor) -> torch.Tensor:
    """`probs` with the entries of `rows` below their row's threshold set to 0."""
    index = torch.from_numpy(rows).to(probs.device)
    selected = probs[index]
    kept = torch.where(selected >= thresholds[:, None], selected, 0.0)
    return probs.index_copy(0, index, kept)
