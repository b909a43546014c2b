"""Bad client input is rejected with a reason while the other requests complete correctly;
utility calls answer; the asyncio client streams outputs on uvloop.
"""

import time

import msgspec
import pytest

from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import UtilityCallError
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.service.client_router import MALFORMED_REQ_ID
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, launch, stop_launch, wait_for
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MODEL = "checksum"  # vocabulary of 1024 tokens
MAX_MODEL_LEN = 128
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def raw_request(req_id: str, **overrides: object) -> bytes:
    """An EngineCoreRequest frame with fields replaced, as a buggy client could send it."""
    fields = msgspec.to_builtins(make_request(req_id, [5, 6, 7], PARAMS), builtin_types=(bytes,))
    fields["type"] = "EngineCoreRequest"
    fields.update(overrides)
    return msgspec.msgpack.encode(fields)


@pytest.mark.timeout(90)
def test_bad_input_is_rejected_with_a_reason_while_others_complete(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 2, MODEL, "--max-model-len", str(MAX_MODEL_LEN))
    good = {f"good-{i}": [3 + i, 40, 41, 42, 43, 44] * 5 for i in range(4)}
    bad_requests = {
        "empty": make_request("empty", [], PARAMS),
        "too-long": make_request("too-long", [7] * (MAX_MODEL_LEN + 1), PARAMS),
        "out-of-vocab": make_request("out-of-vocab", [5, 5000], PARAMS),
        "good-0": make_request("good-0", [9, 9, 9], PARAMS),  # a duplicate of a live req_id
    }
    with EngineClient(addresses["client"], 60.0) as client:
        for req_id, prompt in good.items():
            client.add_request(make_request(req_id, prompt, PARAMS))
        for req_id, request in bad_requests.items():
            if req_id != "good-0":
                client.add_request(request)
        client.send(bad_requests["good-0"])
        client.send(b"\xc1 not msgpack")
        client.send(msgspec.msgpack.encode({"type": "LaunchRockets", "req_id": "unknown-type"}))
        client.send(raw_request("zero-max-tokens", sampling_params=[0]))
        client.send(raw_request("min-over-max", sampling_params=[2, 5]))
        rejected = _collect_rejections(client, good)
    for req_id in (
        "empty",
        "too-long",
        "out-of-vocab",
        "unknown-type",
        "zero-max-tokens",
        "min-over-max",
    ):
        assert rejected.get(req_id), f"{req_id} was not rejected with a reason: {rejected}"
    assert "empty prompt" in rejected["empty"]
    assert "max_model_len" in rejected["too-long"]
    assert "vocabulary" in rejected["out-of-vocab"]
    assert "LaunchRockets" in rejected["unknown-type"]
    assert "duplicate" in rejected["good-0"]
    assert "sampling_params" in rejected["zero-max-tokens"]
    assert "min_tokens" in rejected["min-over-max"]
    assert rejected.get(MALFORMED_REQ_ID), f"the undecodable frame was not answered: {rejected}"
    stop_launch(processes)


def _collect_rejections(client: EngineClient, good: dict[str, list[int]]) -> dict[str, str]:
    """Run until every good request finished; the error of every other output, by req_id."""
    rejected: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while not all(client.result(req_id).is_finished for req_id in good):
        assert time.monotonic() < deadline, "good requests did not finish"
        for output in client.poll_outputs(0.5):
            if output.error is not None:
                rejected[output.req_id] = output.error
    for req_id, prompt in good.items():
        result = client.result(req_id)
        assert result.error is None, f"{req_id} failed: {result.error}"
        assert result.token_ids == reference_generate(MODEL, prompt, PARAMS), req_id
    return rejected


@pytest.mark.timeout(90)
def test_reset_prefix_cache_reports_success_or_why_not(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 1, "tiny-llama", "--max-model-len", "512")
    with EngineClient(addresses["client"], 60.0) as client:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        client.add_request(make_request("busy", [5, 6, 7, 8], params))
        wait_for(lambda: client.poll_outputs(0.1) or client.result("busy").token_ids, 60, "tokens")
        with pytest.raises(UtilityCallError, match="cannot reset the prefix cache"):
            client.reset_prefix_cache()
        client.abort(["busy"])
        assert client.run_until_finished(["busy"], 30)["busy"].finish_reason == "abort"
        assert client.reset_prefix_cache() is True
        with pytest.raises(UtilityCallError, match="unknown utility method"):
            client.call_utility("format_disk")
    stop_launch(processes)


@pytest.mark.timeout(90)
def test_async_client_streams_concurrent_requests(processes: Processes, addresses: dict) -> None:
    launch(processes, addresses, 1, MODEL)
    prompts = {f"async-{i}": [11 + i] * (20 + i) for i in range(5)}

    async def generate_all() -> dict[str, list[int]]:
        client = AsyncEngineClient(addresses["client"], 60.0)
        try:
            assert await client.call_utility("check_health") is True

            async def one(req_id: str, prompt: list[int]) -> list[int]:
                tokens = []
                async for output in client.generate(make_request(req_id, prompt, PARAMS)):
                    tokens.extend(output.new_token_ids)
                return tokens

            import asyncio

            outs = await asyncio.gather(*(one(r, p) for r, p in prompts.items()))
            return dict(zip(prompts, outs, strict=True))
        finally:
            await client.close()

    served = run_async(generate_all())
    for req_id, prompt in prompts.items():
        assert served[req_id] == reference_generate(MODEL, prompt, PARAMS), req_id
    stop_launch(processes)


def test_raw_request_helper_builds_a_decodable_frame() -> None:
    frame = raw_request("x")
    decoded = msgspec.msgpack.decode(frame, type=EngineCoreRequest)
    assert decoded.prompt_token_ids == pack_int32([5, 6, 7])
