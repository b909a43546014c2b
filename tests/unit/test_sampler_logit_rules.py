"""logit_bias, allowed_token_ids and bad words on the ranks: each rule changes only its own row,
greedy rows included, and a row's token depends on its request alone, never on the batch."""

import numpy as np
import pytest
import torch

from protocol.sampling import SamplingParams
from worker.sampler import SampleBatch, Sampler
from worker.sampling.columns import SamplingTable
from worker.sampling.logit_processors import banned_by_bad_words
from worker.sampling.penalties import TokenHistory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB_SIZE = 8


def ramp_logits(num_rows: int) -> torch.Tensor:
    """Rows whose argmax is the last id, with distinct values: id i has logit i."""
    return torch.arange(VOCAB_SIZE, dtype=torch.float32).repeat(num_rows, 1)


def history_of(sequences: list[list[int]], num_prompt_tokens: list[int]) -> TokenHistory:
    width = max(len(sequence) for sequence in sequences)
    table = np.zeros((len(sequences), width), dtype=np.int32)
    for row, sequence in enumerate(sequences):
        table[row, : len(sequence)] = sequence
    rows = np.arange(len(sequences), dtype=np.int64)
    return TokenHistory(table, rows, np.array(num_prompt_tokens, dtype=np.int64))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], sequences: list[list[int]], num_prompt: int
) -> list[int]:
    history = history_of(sequences, [num_prompt] * len(params))
    positions = [len(sequence) for sequence in sequences]
    batch = SampleBatch(list(range(1, len(params) + 1)), params, positions, history=history)
    return Sampler().sample(logits, batch).tolist()


def test_logit_bias_forces_a_greedy_token_and_leaves_other_rows() -> None:
    params = [SamplingParams(logit_bias={2: 100.0}), SamplingParams()]
    assert sample(ramp_logits(2), params, [[1], [1]], 1) == [2, VOCAB_SIZE - 1]


def test_negative_logit_bias_demotes_the_top_token() -> None:
    params = [SamplingParams(logit_bias={7: -100.0, 6: -1.5})]
    assert sample(ramp_logits(1), params, [[1]], 1) == [5]


def test_allowed_token_ids_mask_every_other_id_at_any_temperature() -> None:
    allowed = [1, 3]
    for seed in range(20):
        params = [SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=allowed)]
        assert sample(ramp_logits(1), params, [[0]], 1)[0] in allowed
    assert sample(ramp_logits(1), [SamplingParams(allowed_token_ids=allowed)], [[0]], 1) == [3]


def test_single_token_bad_word_is_always_banned() -> None:
    params = [SamplingParams(bad_words_token_ids=[[7]])]
    assert sample(ramp_logits(1), params, [[1]], 1) == [6]


def test_bad_word_is_banned_only_where_the_output_ends_with_its_prefix() -> None:
    """[4, 7] bans 7 right after 4 was generated, and nowhere else."""
    params = [SamplingParams(bad_words_token_ids=[[4, 7]])] * 2
    # prompt [1], then output [4] for the first row and [5] for the second
    assert sample(ramp_logits(2), params, [[1, 4], [1, 5]], 1) == [6, 7]


def test_bad_word_spanning_three_tokens_sees_across_token_boundaries() -> None:
    words = [[2, 3, 7]]
    assert banned_by_bad_words(words, [9, 2, 3]) == [7]
    assert banned_by_bad_words(words, [2, 9, 3]) == []
    assert banned_by_bad_words(words, [3]) == []  # shorter than the word's prefix


def test_bad_word_does_not_match_across_the_prompt() -> None:
    """vLLM's rule: only the output counts, so a prompt ending in 4 does not ban 7."""
    params = [SamplingParams(bad_words_token_ids=[[4, 7]])]
    assert sample(ramp_logits(1), params, [[1, 4]], 2) == [7]


def test_rules_leave_the_raw_logits_for_logprobs() -> None:
    logits = ramp_logits(1)
    before = logits.clone()
    sample(logits, [SamplingParams(logit_bias={0: 50.0}, allowed_token_ids=[0, 1])], [[1]], 1)
    assert torch.equal(logits, before)


def test_a_rows_token_does_not_depend_on_the_batch_around_it() -> None:
    """The same seeded, ruled request gives the same tokens alone and among others."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((5, VOCAB_SIZE), generator=generator)
    ruled = SamplingParams(
        temperature=0.8,
        seed=11,
        logit_bias={3: 2.5},
        allowed_token_ids=[0, 2, 3, 5],
        bad_words_token_ids=[[1, 5]],
    )
    others = [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(logit_bias={4: -3.0}),
        SamplingParams(),
        SamplingParams(bad_words_token_ids=[[2]], temperature=0.5, seed=9),
    ]
    sequence = [6, 1]
    alone = sample(logits[2:3], [ruled], [sequence], 1)
    for position in range(5):
        params = [*others[:position], ruled, *others[position:]]
        rows = [*range(position), 2, *range(position, 4)]
        mixed = sample(logits[rows], params, [sequence] * 5, 1)
        assert mixed[position] == alone[0]


def test_sampling_table_counts_ruled_rows_and_leaves_the_column_out_without_them() -> None:
    table = SamplingTable(3)
    table.add_row(0, SamplingParams())
    table.add_row(1, SamplingParams(logit_bias={}))  # empty: no rule
    rows = np.arange(2, dtype=np.int64)
    assert table.take(rows).logit_rules is None
    ruled = SamplingParams(allowed_token_ids=[1])
    table.add_row(2, ruled)
    columns = table.take(np.arange(3, dtype=np.int64))
    assert columns.logit_rules is not None and columns.logit_rules.tolist() == [False, False, True]
    assert columns.needs_history
    table.remove_row(2, ruled)
    table.check_invariants([SamplingParams(), SamplingParams(logit_bias={})])
    assert table.take(rows).logit_rules is None
