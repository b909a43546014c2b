"""Penalties, top-k, top-p and min-p against small references computed straight from their rules.

The filters run on the sampler's 2**-16 grid; the references here use exact fractions.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.sampling import SamplingParams
from worker.input_batch import InputBatch
from worker.numerics.fixed_point import PROB_FRAC_BITS
from worker.sampler import SampleBatch, Sampler, greedy_tokens
from worker.sampling import filters, penalties
from worker.sampling.columns import SamplingColumns
from worker.sampling.filters import filter_probabilities
from worker.sampling.penalties import TokenHistory, apply_penalties

GRID = 1 << PROB_FRAC_BITS
NUM_DRAWS = 400

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _logits(seed: int, rows: int = 1, vocab_size: int = 48) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((rows, vocab_size), generator=generator, dtype=torch.float64) * 6


def _draws(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None = None):
    """The ids one request draws at positions 0..NUM_DRAWS-1 from the same logits row."""
    sampler = Sampler()
    return [
        int(sampler.sample(logits, SampleBatch.one(1, params, pos, history))[0])
        for pos in range(NUM_DRAWS)
    ]


def test_top_k_1_and_a_tiny_top_p_are_greedy() -> None:
    logits = _logits(1)
    top = int(torch.argmax(logits))
    for params in (
        SamplingParams(temperature=1.5, seed=3, top_k=1),
        SamplingParams(temperature=1.5, seed=3, top_p=1e-9),
        SamplingParams(temperature=1.5, seed=3, min_p=1.0),
    ):
        assert set(_draws(logits, params)) == {top}, params


def test_top_k_draws_only_and_all_of_the_k_most_likely() -> None:
    logits = _logits(2)
    most_likely = set(torch.argsort(logits[0], descending=True)[:5].tolist())
    assert set(_draws(logits, SamplingParams(temperature=5.0, seed=1, top_k=5))) == most_likely


def test_top_p_keeps_the_smallest_set_of_that_mass_and_min_p_a_fraction_of_the_top() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]  # exp(logit) up to a constant; on the grid, 1, 0.6, 0.3, 0.1
    logits = torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)
    for top_p, kept in ((0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        params = SamplingParams(temperature=1.0, seed=2, top_p=top_p)
        assert set(_draws(logits, params)) == kept, top_p
    for min_p, kept in ((0.05, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.5, {0, 1})):
        params = SamplingParams(temperature=1.0, seed=2, min_p=min_p)
        assert set(_draws(logits, params)) == kept, min_p


def _reference_filter(row: list[int], top_k: int, top_p: float, min_p: float) -> list[int]:
    """Grid units (value * 2**16) kept by min_p, then top_k, then top_p (vLLM's order), in exact
    arithmetic."""
    kept = list(row)
    if min_p > 0.0:
        threshold = Fraction(min_p) * max(kept)
        kept = [v if v >= threshold else 0 for v in kept]
    if top_k < len(kept):
        kth = sorted(kept, reverse=True)[top_k - 1]
        kept = [v if v >= kth else 0 for v in kept]
    if top_p < 1.0:
        total, mass = sum(kept), 0
        for value in sorted(kept, reverse=True):  # the first value where the mass is reached
            mass += value
            if mass >= Fraction(top_p) * total:
                kept = [v if v >= value else 0 for v in kept]
                break
    return kept


grid_rows = st.lists(st.integers(0, 8), min_size=5, max_size=5).map(
    lambda units: [GRID, *[u * GRID // 8 for u in units]]  # many ties; the top is 1
)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(grid_rows, min_size=1, max_size=4),
    top_k=st.lists(st.integers(1, 7), min_size=4, max_size=4),
    top_p=st.lists(st.sampled_from([1.0, 0.99, 0.7, 0.5, 0.3, 0.01]), min_size=4, max_size=4),
    min_p=st.lists(st.sampled_from([0.0, 0.1, 0.26, 0.5, 1.0]), min_size=4, max_size=4),
)
def test_filters_equal_an_exact_reference_row_by_row(
    rows: list[list[int]], top_k: list[int], top_p: list[float], min_p: list[float]
) -> None:
    num_rows = len(rows)
    probs = torch.tensor(rows, dtype=torch.float64) / GRID
    got = filter_probabilities(
        probs,
        np.array(top_k[:num_rows], dtype=np.int64),
        np.array(top_p[:num_rows]),
        np.array(min_p[:num_rows]),
    )
    expected = [
        _reference_filter(row, top_k[idx], top_p[idx], min_p[idx]) for idx, row in enumerate(rows)
    ]
    assert (got * GRID).to(torch.int64).tolist() == expected


def test_penalties_change_logits_as_the_formulas_say() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    prompt, output = [0, 1], [2, 3, 3]  # ids 4 and 5 never occur
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    columns = SamplingColumns.from_params([params])
    history = TokenHistory.one(prompt + output, len(prompt))
    got = apply_penalties(logits, columns, history, np.array([5]))[0].tolist()
    counts = {2: 1, 3: 2}
    expected = []
    for token_id, logit in enumerate(logits[0].tolist()):
        if token_id in prompt or token_id in output:  # repetition: prompt and output
            logit = logit / 2.0 if logit > 0 else logit * 2.0
        if token_id in counts:  # frequency per occurrence, presence once, output only
            logit -= 0.25 * counts[token_id] + 0.5
        expected.append(logit)
    assert got == pytest.approx(expected, abs=1e-15)
    assert logits[0, 0] == 1.0, "the raw logits stay for logprobs"


def test_penalties_steer_greedy_too() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.2]], dtype=torch.float64)
    history = TokenHistory.one([3, 1], 1)  # id 1 was generated
    greedy = SamplingParams()
    penalized = SamplingParams(presence_penalty=0.5)
    assert int(Sampler().sample(logits, SampleBatch.one(1, greedy, 2, history))[0]) == 1
    assert int(Sampler().sample(logits, SampleBatch.one(1, penalized, 2, history))[0]) == 2
    with pytest.raises(ValueError, match="penalized or min_tokens requests but no token history"):
        SampleBatch.one(1, penalized, 2)


def test_a_mixed_batch_samples_each_row_as_it_would_alone_whatever_the_order() -> None:
    """Filters, penalties and temperature rows among greedy ones: each row's token is the one it
    draws alone, and reversing the rows (another batch composition) changes none."""
    logits = _logits(7, rows=6)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=4, top_k=6, top_p=0.8),
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(temperature=1.2, seed=9, min_p=0.2, frequency_penalty=0.6),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(temperature=2.0, seed=5, presence_penalty=-1.5),
    ]
    sequences = [[(3 * row + idx) % 48 for idx in range(9)] for row in range(6)]
    table = np.array(sequences, dtype=np.int32)
    handles, positions = [4, 9, 2, 7, 1, 3], [9] * 6
    order = list(range(6))
    sampler = Sampler(21)

    def sample(rows: list[int]) -> list[int]:
        history = TokenHistory(table, np.array(rows), np.array([4] * len(rows)))
        batch = SampleBatch(
            [handles[r] for r in rows], [params[r] for r in rows], [9] * len(rows), None, history
        )
        return sampler.sample(logits[rows], batch).tolist()

    together = sample(order)
    alone = [sample([row])[0] for row in order]
    assert together == alone
    assert sample(order[::-1]) == together[::-1]
    assert positions == [9] * 6


def test_a_batch_without_a_feature_skips_its_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows with no penalty cost one argmax: neither the penalty nor the filter pass
    runs, and the runner's columns for them are all None."""

    def refuse(*args: object) -> None:
        raise AssertionError("a pass ran for a batch that does not use it")

    monkeypatch.setattr(penalties, "penalized_rows", refuse)
    monkeypatch.setattr(filters, "_keep_at_least", refuse)
    logits = _logits(3, rows=4)
    batch = InputBatch(max_model_len=16, block_sizes=[4])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)]
    for handle in range(4):
        batch.add_request(handle, np.array([1, 2, 3]), params[handle % 2], ([handle + 1],))
    rows = np.arange(4, dtype=np.int64)
    columns = batch.sampling.take(rows)
    assert columns.temperature is not None
    assert (columns.top_k, columns.repetition_penalty, columns.num_logprobs) == (None, None, None)
    sample_batch = SampleBatch([0, 1, 2, 3], [params[h % 2] for h in range(4)], [3] * 4, columns)
    tokens = Sampler().sample(logits, sample_batch)
    assert tokens[0::2].tolist() == greedy_tokens(logits[0::2]).tolist()
    batch.remove_request(1)
    batch.remove_request(3)
    batch.check_invariants()
    assert batch.sampling.take(np.arange(2, dtype=np.int64)) == SamplingColumns()


def test_the_sampling_table_counts_follow_rows_that_come_and_go() -> None:
    batch = InputBatch(max_model_len=8, block_sizes=[4])
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(top_k=3),  # greedy: its filter does not count
        SamplingParams(repetition_penalty=1.2, logprobs=2),
    ]
    for handle in range(40):  # past the first rows: the table grows with the batch
        batch.add_request(handle, np.array([1, 2]), kinds[handle % 4], ([handle + 1],))
    batch.check_invariants()
    table = batch.sampling
    assert (table.num_random_rows, table.num_filtered_rows) == (10, 10)
    assert (table.num_penalized_rows, table.num_logprob_rows) == (10, 10)
    for handle in range(0, 40, 3):
        batch.remove_request(handle)
        batch.check_invariants()
    for handle, row in batch.handle_to_row.items():  # moved rows keep their own settings
        params = kinds[handle % 4]
        assert table.temperature[row] == params.temperature
        assert table.repetition_penalty[row] == params.repetition_penalty
    assert table.num_logprob_rows == sum(h % 4 == 3 for h in batch.handle_to_row)
    table.top_p[0] = 0.5  # a planted corruption: the row's own params say 1.0
    with pytest.raises(AssertionError, match=r"sampling column top_p holds \[0.5\] at rows \[0\]"):
        batch.check_invariants()


def test_min_tokens_holds_back_stop_and_eos_ids_until_enough_outputs() -> None:
    """vLLM's rule: a request cannot draw its stop ids, nor EOS ids unless ignore_eos, before
    min_tokens outputs exist; the raw logits stay as they were."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]], dtype=torch.float64)  # 1 > 2 > 3 > 4
    sampler = Sampler(eos_token_ids=[1, 2])
    prompt = [4, 4]

    def greedy(num_outputs: int, **params: object) -> int:
        history = TokenHistory.one(prompt + [0] * num_outputs, len(prompt))
        batch = SampleBatch.one(1, SamplingParams(**params), len(prompt) + num_outputs, history)
        return int(sampler.sample(logits, batch)[0])

    assert greedy(0, min_tokens=2, stop_token_ids=[3]) == 4  # both EOS ids and the stop id
    assert greedy(1, min_tokens=2, stop_token_ids=[3]) == 4
    assert greedy(2, min_tokens=2, stop_token_ids=[3]) == 1  # enough outputs: EOS may come
    assert greedy(0, min_tokens=2, ignore_eos=True, stop_token_ids=[1]) == 2
    assert greedy(0, min_tokens=1, ignore_eos=True) == 1
    drawn = {
        int(sampler.sample(logits, SampleBatch.one(1, params, 2, TokenHistory.one(prompt, 2))))
        for params in [SamplingParams(temperature=3.0, seed=s, min_tokens=1) for s in range(60)]
    }
    assert drawn == {0, 3, 4}
    assert logits[0].tolist() == [0.0, 5.0, 4.0, 3.0, 1.0]
