"""Grid candidates: the ids of each row that can have a nonzero probability on the sampler's grid,
with those probabilities, so that filters and the draw look at them alone.

On the grid (multiples of 2**-16, the top id at exactly 1) an id whose exp((logit - max) / T) is
below 2**-17 rounds to 0, and an id of probability 0 adds nothing to any running sum or filter
threshold. A real model's distribution leaves a few thousand of Qwen's 151,936 ids above that, so
drawing over them gives the very tokens the whole row would, at a fraction of the cost.
"""

import torch

from worker.numerics.fixed_point import PROB_FRAC_BITS, quantize

# exp(s) rounds to 0 on the grid for s < -17 ln 2 (about -11.78); the rough pass in the logits'
# dtype keeps every id at or above -12, a margin far wider than its rounding error
CANDIDATE_CUTOFF = -12.0


def grid_candidates(logits: torch.Tensor, temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [S, K] int64, probs [S, K] float64 on the grid): each row's candidates in ascending
    id order, padded at the end with id 0 of probability 0, K the most any row has.

    A candidate's probability is computed exactly as the whole row's would be: float64
    (logit - row max) / temperature, exp, rounded to the grid.

    Args:
        logits: [S, V], any float dtype.
        temps: [S] float64, each row's temperature (> 0).
    """
    maxima = logits.amax(dim=-1, keepdim=True)  # [S, 1]; a maximum is exact in any dtype
    # logit >= max + CUTOFF * T, one pass over the rows (the cutoff's margin covers its rounding)
    floors = maxima + CANDIDATE_CUTOFF * temps.to(logits.dtype)[:, None]
    is_candidate = logits >= floors  # [S, V]; every row keeps its maximum
    rows, cols = is_candidate.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    counts = torch.bincount(rows, minlength=logits.shape[0])  # [S]
    starts = torch.cumsum(counts, dim=0) - counts
    slots = torch.arange(len(rows), device=logits.device) - starts[rows]
    num_slots = int(counts.max())
    maxima = maxima[:, 0].to(torch.float64)
    shifted = (logits[rows, cols].to(torch.float64) - maxima[rows]) / temps[rows]
    ids = torch.zeros((logits.shape[0], num_slots), dtype=torch.int64, device=logits.device)
    probs = torch.zeros((logits.shape[0], num_slots), dtype=torch.float64, device=logits.device)
    ids[rows, slots] = cols
    probs[rows, slots] = quantize(torch.exp(shifted), PROB_FRAC_BITS, 1)
    return ids, probs
