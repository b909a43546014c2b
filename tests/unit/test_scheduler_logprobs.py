"""Logprobs through the engine: each delivered token carries its own entry, and only its own.

The fake workers (fake_executor.fake_logprobs) name each entry's token and position, so an entry
shifted by a partial chunk, a token discarded past a stop, a preemption or an abort is seen.
"""

from array import array

import pytest
from fake_executor import MakeHarness, fake_logprobs, reference_tokens

from engine_core.sched.reply_logprobs import read_reply_logprobs
from engine_core.sched.request import Request
from protocol.buffers import pack_int32
from protocol.client_messages import FinishReason
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput

VOCAB_SIZE = 64
PROMPTS = [[7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 2, 3], [2, 4, 6], [5, 5, 5, 5, 1]]


def _expected(harness_tokens: list[int], prompt: list[int], num_logprobs: int) -> list:
    return [
        fake_logprobs(token_id, len(prompt) + idx, num_logprobs, VOCAB_SIZE)
        for idx, token_id in enumerate(harness_tokens)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_token_comes_with_its_own_logprobs_through_chunks_and_preemption(
    make_harness: MakeHarness, async_scheduling: bool
) -> None:
    harness = make_harness(
        num_blocks=12,
        max_model_len=32,
        max_num_batched_tokens=8,
        async_scheduling=async_scheduling,
    )
    harness.add("two", PROMPTS[0], max_tokens=12, logprobs=2)  # its prompt comes in two chunks
    harness.add("none", PROMPTS[1], max_tokens=12)
    harness.add("zero", PROMPTS[2], max_tokens=12, logprobs=0)
    harness.run()
    assert harness.scheduler.num_preemptions > 0, "the small pool should preempt"
    for req_id, prompt in zip(("two", "none", "zero"), PROMPTS, strict=True):
        assert harness.tokens[req_id] == reference_tokens(prompt, 12, VOCAB_SIZE)
    assert harness.logprobs["two"] == _expected(harness.tokens["two"], PROMPTS[0], 2)
    assert harness.logprobs["zero"] == _expected(harness.tokens["zero"], PROMPTS[2], 0)
    assert "none" not in harness.logprobs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_token_past_a_stop_is_discarded_with_its_logprobs(
    make_harness: MakeHarness, async_scheduling: bool
) -> None:
    """With asynchronous scheduling the ranks sample one token past the stop: its entry must
    not shift onto a later output of another request."""
    tokens = reference_tokens(PROMPTS[1], 10, VOCAB_SIZE)
    stop_idx = 3
    harness = make_harness(async_scheduling=async_scheduling)
    harness.add("stops", PROMPTS[1], max_tokens=10, stop_token_ids=[tokens[stop_idx]], logprobs=1)
    harness.add("runs", PROMPTS[2], max_tokens=10, logprobs=3)
    harness.run()
    assert harness.tokens["stops"] == tokens[: tokens.index(tokens[stop_idx]) + 1]
    assert harness.finish_reasons["stops"] == FinishReason.STOP
    for req_id, prompt, num_logprobs in (("stops", PROMPTS[1], 1), ("runs", PROMPTS[2], 3)):
        expected = _expected(harness.tokens[req_id], prompt, num_logprobs)
        assert harness.logprobs[req_id] == expected, req_id


def test_an_abort_while_a_step_runs_leaves_the_others_aligned(make_harness: MakeHarness) -> None:
    harness = make_harness(async_scheduling=True)
    for req_id, prompt in zip(("a", "b", "c"), PROMPTS, strict=True):
        harness.add(req_id, prompt, max_tokens=8, logprobs=1)
    for _ in range(4):
        harness.step()
    harness.abort(["b"])  # its entries still come back in the steps in flight
    harness.run()
    assert harness.finish_reasons["b"] == FinishReason.ABORT
    for req_id, prompt in zip(("a", "b", "c"), PROMPTS, strict=True):
        expected = _expected(harness.tokens[req_id], prompt, 1)
        assert harness.logprobs.get(req_id, []) == expected, req_id
    assert len(harness.logprobs["a"]) == 8


def _reply(ids: list[int], values: list[float], ranks: list[int], sampled: list[int]) -> tuple:
    output = ModelRunnerOutput(
        1,
        0,
        pack_int32([1, 2]),
        pack_int32(sampled),
        1,
        array("f", values).tobytes(),
        pack_int32(ids),
        pack_int32(ranks),
    )
    requests = [
        Request("a", [1], SamplingParams(logprobs=1)),
        Request("b", [1], SamplingParams()),
    ]
    return output, requests


def test_reply_columns_that_do_not_match_the_sampled_tokens_are_refused() -> None:
    output, requests = _reply([5, 6], [-0.5, -1.0], [1], [5, 9])
    (entry, none) = read_reply_logprobs(output, requests, [True, True], array("i", [5, 9]))
    assert none is None and entry is not None
    assert (entry.token_ids, entry.logprobs, entry.sampled_token_ranks) == (
        [[5, 6]],
        [[-0.5, -1.0]],
        [1],
    )
    for bad, message in [
        (_reply([6, 5], [-0.5, -1.0], [1], [5, 9]), "entry 0 .* leads with another id"),
        (_reply([5], [-0.5], [1], [5, 9]), "entry 0 .* is missing"),
        (_reply([5, 6], [-0.5], [1], [5, 9]), "1 logprobs and 2 logprob token ids"),
        (_reply([5, 6, 7], [-0.5, -1.0, -2.0], [1], [5, 9]), "expected 1 \\(2 values\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            read_reply_logprobs(bad[0], bad[1], [True, True], array("i", [5, 9]))
    # a request whose step only ran a prompt chunk has no entry
    output, requests = _reply([], [], [], [0, 9])
    assert read_reply_logprobs(output, requests, [False, True], array("i", [0, 9])) == [None, None]
