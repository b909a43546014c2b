"""Stop rules: max_tokens, stop_token_ids, EOS ids and ignore_eos, min_tokens, max_model_len."""

import random

import pytest
from fake_executor import MakeHarness, reference_tokens

from engine_core.sched.request import Request
from protocol.client_messages import FinishReason
from protocol.sampling import SamplingParams

VOCAB_SIZE = 64


def _story() -> tuple[list[int], list[int], int]:
    """A prompt, its first 40 reference tokens, and an index k >= 3 where a token first appears."""
    rng = random.Random(11)
    while True:
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(6)]
        tokens = reference_tokens(prompt, 40, VOCAB_SIZE)
        for idx in range(3, 30):
            if tokens[idx] not in tokens[:idx]:
                return prompt, tokens, idx


def test_max_tokens_finishes_with_length(make_harness: MakeHarness) -> None:
    prompt, tokens, _ = _story()
    harness = make_harness()
    harness.add("r", prompt, max_tokens=5)
    harness.run()
    assert harness.tokens["r"] == tokens[:5]
    assert harness.finish_reasons["r"] == FinishReason.LENGTH


def test_stop_token_id_finishes_with_stop_and_keeps_the_token(make_harness: MakeHarness) -> None:
    prompt, tokens, k = _story()
    harness = make_harness()
    harness.add("r", prompt, max_tokens=40, stop_token_ids=[tokens[k]])
    harness.run()
    assert harness.tokens["r"] == tokens[: k + 1]
    assert harness.finish_reasons["r"] == FinishReason.STOP


def test_eos_finishes_with_stop(make_harness: MakeHarness) -> None:
    prompt, tokens, k = _story()
    harness = make_harness(eos_token_ids=[tokens[k]])
    harness.add("r", prompt, max_tokens=40, ignore_eos=False)
    harness.run()
    assert harness.tokens["r"] == tokens[: k + 1]
    assert harness.finish_reasons["r"] == FinishReason.STOP


def test_ignore_eos_runs_past_eos(make_harness: MakeHarness) -> None:
    prompt, tokens, k = _story()
    harness = make_harness(eos_token_ids=[tokens[k]])
    harness.add("r", prompt, max_tokens=k + 5, ignore_eos=True)
    harness.run()
    assert harness.tokens["r"] == tokens[: k + 5]
    assert harness.finish_reasons["r"] == FinishReason.LENGTH


def test_min_tokens_holds_back_eos_and_stop_ids(make_harness: MakeHarness) -> None:
    prompt, tokens, k = _story()
    min_tokens, max_tokens = k + 2, k + 12
    # The first output at or past min_tokens that is the stop token ends the request.
    stop_idx = next(
        (idx for idx in range(min_tokens - 1, max_tokens) if tokens[idx] == tokens[k]), None
    )
    expected = tokens[:max_tokens] if stop_idx is None else tokens[: stop_idx + 1]
    expected_reason = FinishReason.LENGTH if stop_idx is None else FinishReason.STOP
    harness = make_harness(eos_token_ids=[tokens[k]])
    harness.add("eos", prompt, max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=False)
    harness.add(
        "stop", prompt, max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=[tokens[k]]
    )
    harness.run()
    for req_id in ("eos", "stop"):
        assert harness.tokens[req_id] == expected
        assert len(harness.tokens[req_id]) > k + 1  # the early stop token did not stop it
        assert harness.finish_reasons[req_id] == expected_reason


def test_max_model_len_finishes_with_length(make_harness: MakeHarness) -> None:
    prompt, tokens, _ = _story()
    harness = make_harness(max_model_len=10)
    harness.add("r", prompt, max_tokens=100)
    harness.run()
    assert harness.tokens["r"] == tokens[:4]  # 6 prompt tokens + 4 reach max_model_len=10
    assert harness.finish_reasons["r"] == FinishReason.LENGTH


def test_prompt_of_exactly_max_model_len_yields_one_token(make_harness: MakeHarness) -> None:
    harness = make_harness(max_model_len=8)
    harness.add("r", list(range(8)), max_tokens=10)
    harness.run()
    assert len(harness.tokens["r"]) == 1
    assert harness.finish_reasons["r"] == FinishReason.LENGTH


def _two_firsts() -> tuple[list[int], list[int], int, int]:
    """A prompt, its first 40 reference tokens, and indexes 3 <= j < k of two ids first seen
    there: a model that lists both as EOS ids (as generation_config.json may)."""
    prompt, tokens, j = _story()
    k = next(idx for idx in range(j + 1, 40) if tokens[idx] not in tokens[:idx])
    return prompt, tokens, j, k


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_either_of_two_eos_ids_finishes_with_stop(
    make_harness: MakeHarness, async_scheduling: bool
) -> None:
    prompt, tokens, j, k = _two_firsts()
    harness = make_harness(eos_token_ids=[tokens[k], tokens[j]], async_scheduling=async_scheduling)
    harness.add("first", prompt, max_tokens=40, ignore_eos=False)
    harness.add("later", prompt, max_tokens=40, ignore_eos=False, min_tokens=j + 2)
    harness.add("ignores", prompt, max_tokens=k + 3, ignore_eos=True)
    harness.add("stop id", prompt, max_tokens=40, ignore_eos=True, stop_token_ids=[tokens[k]])
    harness.run()
    assert harness.tokens["first"] == tokens[: j + 1]  # the second-listed id came first
    later = next(idx for idx in range(j + 1, 40) if tokens[idx] in (tokens[j], tokens[k]))
    assert harness.tokens["later"] == tokens[: later + 1]  # min_tokens held the first back
    assert harness.tokens["ignores"] == tokens[: k + 3]
    assert harness.tokens["stop id"] == tokens[: k + 1]  # ignore_eos keeps the stop ids
    for req_id, reason in [
        ("first", FinishReason.STOP),
        ("later", FinishReason.STOP),
        ("ignores", FinishReason.LENGTH),
        ("stop id", FinishReason.STOP),
    ]:
        assert harness.finish_reasons[req_id] == reason, req_id
    request_eos = Request("r", prompt, SamplingParams(), eos_token_ids=[tokens[k], tokens[j]])
    assert request_eos.finishing_token_ids == {tokens[j], tokens[k]}
