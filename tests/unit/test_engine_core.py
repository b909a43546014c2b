"""EngineCore: rejections with reasons, per-client outputs, failures, management calls."""

import math

import msgspec
import pytest
from fake_executor import Harness, MakeHarness, reference_tokens

from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest, FinishReason
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput


def _rejection(harness: Harness, request: EngineCoreRequest) -> str:
    outputs = harness.core.add_request(request, b"client")
    assert outputs is not None, "the request was accepted"
    (output,) = outputs.outputs
    assert output.finish_reason == FinishReason.ERROR and output.new_token_ids == []
    assert output.error
    return output.error


def _request(req_id: str, prompt: bytes, **params: object) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, prompt, SamplingParams(**params), 0.0)


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        (b"", {}, ["empty prompt", "at least 1"]),
        (pack_int32(range(129)), {}, ["129 tokens", "max_model_len=128"]),
        (pack_int32([1, 64]), {}, ["token id 64", "< 64"]),
        (pack_int32([-1, 2]), {}, ["token id -1", "0 <= id"]),
        (b"\x01\x02\x03", {}, ["3 bytes", "multiple of 4"]),
        (pack_int32([1]), {"max_tokens": 0}, ["sampling parameters", "max_tokens"]),
        (pack_int32([1]), {"temperature": -1.0}, ["sampling parameters", "temperature"]),
        (pack_int32([1]), {"stop_token_ids": [99]}, ["stop_token_ids token id 99", "< 64"]),
        (pack_int32([1]), {"logit_bias": {3: 1.0, 64: 2.0}}, ["logit_bias token id 64", "< 64"]),
        (pack_int32([1]), {"allowed_token_ids": [1, 70]}, ["allowed_token_ids token id 70"]),
        (pack_int32([1]), {"bad_words_token_ids": [[2], [3, 64]]}, ["bad_words token id 64"]),
        (pack_int32([1]), {"logit_bias": {3: 101.0}}, ["sampling parameters", "logit_bias"]),
    ],
)
def test_bad_input_is_rejected_with_a_reason(
    make_harness: MakeHarness, prompt: bytes, params: dict, words: list[str]
) -> None:
    harness = make_harness()
    error = _rejection(harness, _request("bad", prompt, **params))
    for word in words:
        assert word in error, error
    assert not harness.scheduler.requests


@pytest.mark.parametrize("arrival_time", [math.nan, math.inf, -math.inf])
def test_non_finite_arrival_time_is_rejected(
    make_harness: MakeHarness, arrival_time: float
) -> None:
    """A NaN arrival compares neither below nor above others and broke the priority heap."""
    harness = make_harness(scheduling_policy="priority")
    request = EngineCoreRequest("bad", pack_int32([1, 2]), SamplingParams(), arrival_time)
    error = _rejection(harness, request)
    assert "arrival_time" in error and "not finite" in error, error
    assert not harness.scheduler.requests


def test_duplicate_req_id_is_rejected_and_the_first_keeps_running(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness()
    harness.add("dup", [1, 2, 3], max_tokens=3)
    error = _rejection(harness, _request("dup", pack_int32([4, 5])))
    assert "duplicate req_id 'dup'" in error
    harness.run()
    assert harness.tokens["dup"] == reference_tokens([1, 2, 3], 3, harness.vocab_size)


def test_min_tokens_above_max_tokens_is_rejected_at_decode() -> None:
    raw = msgspec.msgpack.encode(
        {
            "type": "EngineCoreRequest",
            "req_id": "r",
            "prompt_token_ids": b"\0\0\0\0",
            "sampling_params": [2, 5],
            "arrival_time": 0.0,
        }
    )
    decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    with pytest.raises(msgspec.ValidationError, match="min_tokens"):
        decoder.decode(raw)


def test_outputs_are_keyed_by_client(make_harness: MakeHarness) -> None:
    harness = make_harness()
    harness.add("a", [1, 2], client_id=b"alice", max_tokens=2)
    harness.add("b", [3, 4], client_id=b"bob", max_tokens=2)
    outputs = harness.step()
    assert sorted(outputs) == [b"alice", b"bob"]
    assert [out.req_id for out in outputs[b"alice"].outputs] == ["a"]
    assert outputs[b"alice"].timestamp > 0
    harness.run()


def test_idle_engine_steps_to_nothing(make_harness: MakeHarness) -> None:
    harness = make_harness()
    assert harness.core.step() == {}
    assert harness.executor.num_steps == 0
    assert not harness.core.has_unfinished_requests()


def test_finished_ids_reach_the_workers_in_an_empty_step(make_harness: MakeHarness) -> None:
    harness = make_harness()
    harness.add("r", [1, 2, 3], max_tokens=1)
    harness.step()
    assert not harness.core.has_unfinished_requests()
    harness.step()
    last = harness.scheduler_outputs[-1]
    assert last.total_num_scheduled_tokens == 0 and last.finished_handles == [1]
    assert harness.core.step() == {}


def test_fail_all_errors_every_request_and_frees_its_blocks(make_harness: MakeHarness) -> None:
    harness = make_harness(max_num_seqs=2)
    for idx in range(3):
        harness.add(f"r{idx}", [1, 2, 3, idx], max_tokens=10, client_id=b"c%d" % idx)
    harness.step()
    outputs = harness.core.fail_all("worker rank 1 died")
    assert sorted(outputs) == [b"c0", b"c1", b"c2"]
    for client_outputs in outputs.values():
        (output,) = client_outputs.outputs
        assert output.finish_reason == FinishReason.ERROR
        assert output.error == "worker rank 1 died"
    assert harness.free_blocks() == harness.num_blocks - 1


def test_fail_all_after_a_failed_execute_lets_the_engine_go_on(make_harness: MakeHarness) -> None:
    harness = make_harness()
    harness.add("r", [1, 2, 3], max_tokens=10)
    harness.core.scheduler.schedule()  # a step whose workers never answered
    harness.core.fail_all("no reply in time")
    harness.executor.last_step_id += 1  # the fake workers never saw that step
    harness.executor.requests.clear()
    harness.executor.seen_handles.clear()
    harness.scheduler._finished_handles.clear()
    harness.add("next", [4, 5], max_tokens=2)
    harness.run()
    assert len(harness.tokens["next"]) == 2


@pytest.mark.parametrize(
    ("handles", "sampled", "words"),
    [([99], [1], "other requests"), ([1], [1, 2], "sampled 2 tokens for step 1")],
)
def test_runner_output_that_does_not_answer_the_step_is_refused(
    make_harness: MakeHarness, handles: list[int], sampled: list[int], words: str
) -> None:
    harness = make_harness()
    harness.add("r", [1, 2, 3], max_tokens=2)
    scheduler_output = harness.scheduler.schedule()
    wrong = ModelRunnerOutput(scheduler_output.step_id, 0, pack_int32(handles), pack_int32(sampled))
    with pytest.raises(ValueError, match=words):
        harness.scheduler.update_from_output(scheduler_output, wrong)
    harness.core.fail_all("bad reply")
    harness.executor.last_step_id += 1
    harness.scheduler._finished_handles.clear()


def test_reset_prefix_cache_fails_with_a_reason_while_requests_run(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness()
    harness.add("r", list(range(12)), max_tokens=3)
    harness.step()
    ok, reason = harness.core.reset_prefix_cache()
    assert not ok and reason is not None
    assert reason.endswith("running requests hold blocks (1 running, expected 0)"), reason
    harness.run()
    assert harness.core.reset_prefix_cache() == (True, None)
    harness.add("again", list(range(12)), max_tokens=1)
    harness.run()
    assert harness.num_cached_tokens["again"] == 0


def test_stats_count_running_waiting_hits_and_preemptions(make_harness: MakeHarness) -> None:
    harness = make_harness(max_num_seqs=1)
    harness.add("a", list(range(12)), max_tokens=2)
    harness.add("b", list(range(12)), max_tokens=2)
    harness.step()
    stats = harness.core.get_stats()
    assert stats["num_running_reqs"] == 1 and stats["num_waiting_reqs"] == 1
    assert 0.0 < stats["kv_cache_usage"] <= 1.0
    harness.run()
    stats = harness.core.get_stats()
    assert stats["prefix_cache_queries"] == 24
    assert stats["prefix_cache_hits"] == 8  # b found a's two full blocks of the prompt
    assert stats["num_preemptions"] == 0 and stats["num_running_reqs"] == 0
