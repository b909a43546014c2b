"""Stop rules: max_tokens, stop_token_ids, EOS (and ignore_eos), min_tokens and max_model_len."""

import random

from fake_executor import MakeHarness, reference_tokens

from protocol.client_messages import FinishReason

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
