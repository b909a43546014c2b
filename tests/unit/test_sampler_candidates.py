"""Drawing over each row's grid candidates gives exactly the ids a draw over the whole row gives:
the ids it leaves out round to probability 0 on the grid, so no running sum, filter threshold or
target moves. The whole-row draw below is the sampler's rule written out over every id.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.sampling import SamplingParams
from worker.numerics.fixed_point import PROB_FRAC_BITS, quantize
from worker.sampler import SampleBatch, Sampler, uniform_draw
from worker.sampling.candidates import grid_candidates
from worker.sampling.columns import SamplingColumns
from worker.sampling.filters import filter_probabilities

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def whole_row_draws(logits: torch.Tensor, batch: SampleBatch) -> list[int]:
    """The draw over all V ids of each row: exp on the grid, filters, inverse CDF."""
    columns = SamplingColumns.from_params(batch.sampling_params)
    temps = torch.tensor([p.temperature for p in batch.sampling_params], dtype=torch.float64)
    exact = logits.to(torch.float64)
    probs = quantize(torch.exp((exact - exact.amax(-1, keepdim=True)) / temps[:, None]), 16, 1)
    if columns.has_filters:
        probs = filter_probabilities(probs, columns.top_k, columns.top_p, columns.min_p)
    cumulative = torch.cumsum(probs, dim=-1)
    draws = torch.tensor(
        [
            uniform_draw(p.seed, position)
            for p, position in zip(batch.sampling_params, batch.positions, strict=True)
        ],
        dtype=torch.float64,
    )
    picked = (cumulative <= (draws * cumulative[:, -1])[:, None]).sum(-1)
    return picked.tolist()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.5, 3.0, 12.0]),  # flat (every id a candidate) to peaked (a few)
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.8]),
    top_k=st.sampled_from([None, 1, 5, 400]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.05]),
    masked=st.booleans(),
)
def test_candidate_draws_equal_whole_row_draws(
    seed: int,
    scale: float,
    temperature: float,
    top_k: int | None,
    top_p: float,
    min_p: float,
    masked: bool,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_rows, vocab_size = 6, 300
    logits = torch.randn((num_rows, vocab_size), generator=generator) * scale  # float32
    if masked:  # held-back stop ids and penalties leave -inf in a row
        logits[:, ::7] = -torch.inf
    params = [
        SamplingParams(
            temperature=temperature, seed=seed + row, top_k=top_k, top_p=top_p, min_p=min_p
        )
        for row in range(num_rows)
    ]
    batch = SampleBatch(list(range(num_rows)), params, [row * 3 for row in range(num_rows)])
    assert Sampler().sample(logits, batch).tolist() == whole_row_draws(logits, batch)


def test_candidates_keep_every_id_the_grid_does_not_round_to_zero() -> None:
    logits = torch.tensor([[0.0, -11.7, -11.8, -12.5, -30.0, 2.0]], dtype=torch.float64)
    ids, probs = grid_candidates(logits, torch.tensor([1.0], dtype=torch.float64))
    full = quantize(torch.exp(logits - logits.max()), PROB_FRAC_BITS, 1)[0]
    nonzero = np.flatnonzero(full.numpy()).tolist()
    kept = ids[0].tolist()
    assert set(nonzero) <= set(kept) and 3 not in kept and 4 not in kept
    assert probs[0].tolist() == [full[i].item() for i in kept]
