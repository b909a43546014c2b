"""Sampler: greedy or seeded temperature sampling from logits, the same on every rank.

A draw depends only on (seed, position of the token being sampled): no generator carries state, so
chunking, preemption and TP size cannot change a seeded request's tokens. Probabilities are rounded
to a 2**-16 grid, so their running sums are exact and every rank picks the same token.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.sampling import SamplingParams
from worker.models.fixed_point import PROB_FRAC_BITS, quantize

_MASK_64 = (1 << 64) - 1
_NUMPY_ARGMAX_DTYPES = (torch.float64, torch.float32)


SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL_2 = 0x94D049BB133111EB


def splitmix64(value: int) -> int:
    """A fixed 64-bit mixing function (Steele, Lea and Flood's SplitMix64 finalizer)."""
    z = (value + SPLITMIX_GAMMA) & _MASK_64
    z = ((z ^ (z >> 30)) * SPLITMIX_MUL_1) & _MASK_64
    z = ((z ^ (z >> 27)) * SPLITMIX_MUL_2) & _MASK_64
    return z ^ (z >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by (seed, position), with 53 random bits."""
    return (splitmix64(splitmix64(seed) ^ position) >> 11) / float(1 << 53)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [S] int64, the first maximum on a tie (a NaN counts as the maximum).

    On the CPU numpy's vectorized argmax takes about a sixth of torch's time for float64 rows.
    """
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES:
        tokens = logits.detach().numpy().argmax(axis=-1)
        return torch.from_numpy(tokens.astype(np.int64, copy=False))
    return torch.argmax(logits, dim=-1)


@dataclass(frozen=True, slots=True)
class SampleBatch:
    """What the sampler needs of each row of logits, as columns of one length."""

    handles: Sequence[int]  # the requests' engine handles; seed unseeded temperature sampling
    sampling_params: Sequence[SamplingParams]
    positions: Sequence[int]  # position each sampled token will take in its sequence

    def __post_init__(self) -> None:
        lengths = {len(self.handles), len(self.sampling_params), len(self.positions)}
        if len(lengths) != 1:
            raise ValueError(
                f"sample batch of {len(self.handles)} handles, {len(self.sampling_params)} "
                f"sampling params and {len(self.positions)} positions: expected one length"
            )

    @classmethod
    def one(cls, handle: int, sampling_params: SamplingParams, position: int) -> "SampleBatch":
        return cls([handle], [sampling_params], [position])

    def __len__(self) -> int:
        return len(self.handles)


class Sampler:
    """Turns logits rows into token ids; stateless apart from the seed for unseeded requests."""

    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed

    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        """Token ids [S] int64 for logits [S, V] float64, one row per batch entry in order.

        Greedy rows cost one argmax over all rows; only rows with a temperature are looked at
        one by one.
        """
        if logits.shape[0] != len(batch):
            raise ValueError(f"got {logits.shape[0]} logits rows for {len(batch)} requests")
        tokens = greedy_tokens(logits)
        params = batch.sampling_params
        hot = [i for i, row_params in enumerate(params) if row_params.temperature > 0]
        if hot:
            rows = torch.tensor(hot, dtype=torch.int64, device=logits.device)
            tokens[rows] = self._sample_with_temperature(logits[rows], batch, hot)
        return tokens

    def _sample_with_temperature(
        self, logits: torch.Tensor, batch: SampleBatch, hot: list[int]
    ) -> torch.Tensor:
        """Inverse-CDF draw from softmax(logits / temperature) with per-position uniform
        numbers; `logits` are the rows of batch entries `hot`."""
        device = logits.device
        params, handles, positions = batch.sampling_params, batch.handles, batch.positions
        temps = torch.tensor(
            [params[i].temperature for i in hot], dtype=torch.float64, device=device
        )
        shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]
        # kernels may differ by an ulp in exp; rounding to the grid hides it unless a value lies
        # within an ulp of a grid midpoint (about 1e-11 per value)
        probs = quantize(torch.exp(shifted), PROB_FRAC_BITS, 1)  # [S, V]; the max entry is 1
        cumulative = torch.cumsum(probs, dim=-1)  # exact on the grid
        draws = torch.tensor(
            [uniform_draw(self._seed(params[i], handles[i]), positions[i]) for i in hot],
            dtype=torch.float64,
            device=device,
        )
        targets = draws * cumulative[:, -1]
        picked = (cumulative <= targets[:, None]).sum(dim=-1)
        return torch.clamp(picked, max=logits.shape[1] - 1)

    def _seed(self, sampling_params: SamplingParams, handle: int) -> int:
        seed = sampling_params.seed
        return seed if seed is not None else splitmix64((self.default_seed << 32) ^ handle)
