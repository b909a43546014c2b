"""A prompt far past max_model_len against real processes: the front end refuses it with a 400
before any engine sees it, and the client layer, driven with such a frame directly, refuses it
itself or (sent raw) survives the dropped connection, failing only what was in flight on it.
Guards against the hostile-client fault: one 200,000-token prompt made the front end lose its
engine connection, and every other client got 503 for seconds.
"""

import asyncio
import threading
import time

import httpx
import pytest

from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import EngineConnectionLost, FrameTooLargeError
from engine_client.request import make_request
from protocol.codec import make_encoder
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, launch, stop_launch, stop_process
from tests.integration.test_api_server import API_KEY, LAUNCH_FLAGS, MODEL, start_api
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 2048  # LAUNCH_FLAGS'
HOSTILE_NUM_TOKENS = 200_000
NEIGHBOUR_PROMPT = "a well-behaved neighbour asks again"


def _expected_text(prompt: str, max_tokens: int) -> str:
    tokenizer = ByteTokenizer()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return tokenizer.decode(reference_generate(MODEL, tokenizer.encode(prompt), params))


@pytest.mark.timeout(300)
def test_an_oversized_prompt_is_a_400_and_its_neighbours_are_served(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 1, MODEL, *LAUNCH_FLAGS)
    (port,) = free_tcp_ports(1)
    url = start_api(processes, "api", [addresses["client"]], port, "--api-key", API_KEY)
    headers = {"authorization": f"Bearer {API_KEY}"}
    expected = _expected_text(NEIGHBOUR_PROMPT, 8)
    neighbour_results: list[tuple[int, str]] = []
    is_done = threading.Event()

    def neighbour() -> None:  # streams completions the whole time the hostile client sends
        body = {"prompt": NEIGHBOUR_PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            while not is_done.is_set() or len(neighbour_results) < 3:
                try:
                    response = client.post("/v1/completions", json=body)
                except httpx.TransportError as exc:  # the front end went away: the test fails
                    neighbour_results.append((0, repr(exc)))
                    return
                is_ok = response.status_code == 200
                text = response.json()["choices"][0]["text"] if is_ok else response.text
                neighbour_results.append((response.status_code, text))

    thread = threading.Thread(target=neighbour, daemon=True)
    thread.start()
    hostile_bodies = [
        ({"prompt": [5] * HOSTILE_NUM_TOKENS, "max_tokens": 4}, "prompt"),  # a 600 KB body
        ({"prompt": "x" * HOSTILE_NUM_TOKENS}, "prompt"),
        ({"messages": [{"role": "user", "content": "y" * HOSTILE_NUM_TOKENS}]}, "messages"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "prompt"),  # no room left for one output token
        ({"prompt": "x" * 100, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ]
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as hostile:
            for _ in range(3):
                for body, param in hostile_bodies:
                    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    response = hostile.post(route, json=body)
                    assert response.status_code == 400, response.text
                    assert response.json()["error"]["param"] == param
                    assert "max_model_len=2048" in response.json()["error"]["message"]
    finally:
        is_done.set()
        thread.join(120)
    assert not thread.is_alive()
    assert neighbour_results and all(status == 200 for status, _ in neighbour_results), (
        neighbour_results[:5]
    )
    assert {text for _, text in neighbour_results} == {expected}
    assert "disconnected" not in processes.log("api")
    assert httpx.get(f"{url}/health").status_code == 200
    stop_process(processes, "api")
    stop_launch(processes)


async def _drive_client(address: str) -> dict[str, object]:
    """One AsyncEngineClient: a request too large for the engine's socket beside a normal one,
    then the same frame sent raw, and requests after it."""
    client = AsyncEngineClient(address, timeout_s=60.0)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt_ids = ByteTokenizer().encode(NEIGHBOUR_PROMPT)

    async def tokens(req_id: str, max_tokens: int = 8) -> list[int]:
        request = make_request(req_id, prompt_ids, SamplingParams(max_tokens, ignore_eos=True))
        return [t async for output in client.generate(request) for t in output.new_token_ids]

    try:
        huge = make_request("huge", [5] * HOSTILE_NUM_TOKENS, params)
        beside = asyncio.ensure_future(tokens("beside"))
        refused = None
        try:
            async for _ in client.generate(huge):
                pass
        except FrameTooLargeError as exc:
            refused = str(exc)
        beside_ids = await beside
        # The same frame sent raw, under a long request in flight: the engine drops the
        # connection; only the in-flight request is lost, and the client reconnects.
        victim = asyncio.ensure_future(tokens("victim", 1900))
        while "victim" not in client._queues:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # it is running in the engine
        await client.send_unchecked(make_encoder().encode(huge))
        lost = None
        try:
            await victim
        except EngineConnectionLost as exc:
            lost = str(exc)
        deadline = time.monotonic() + 10
        while client.num_reconnects == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        after_ids = [await tokens(f"after-{idx}") for idx in range(3)]
        stats = await client.call_utility("get_stats")
        return {
            "refused": refused,
            "beside": beside_ids,
            "lost": lost,
            "num_reconnects": client.num_reconnects,
            "after": after_ids,
            "stats": stats,
        }
    finally:
        await client.close()


@pytest.mark.timeout(300)
def test_the_client_survives_a_frame_the_engine_refuses(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 1, MODEL, *LAUNCH_FLAGS)
    tokenizer = ByteTokenizer()
    expected = reference_generate(
        MODEL,
        tokenizer.encode(NEIGHBOUR_PROMPT),
        SamplingParams(max_tokens=8, ignore_eos=True),
    )
    outcome = run_async(_drive_client(addresses["client"]))
    assert isinstance(outcome, dict)
    assert "refuses frames over" in str(outcome["refused"])
    assert outcome["beside"] == expected
    assert "disconnected" in str(outcome["lost"])
    assert outcome["num_reconnects"] == 1
    assert outcome["after"] == [expected] * 3
    stats = outcome["stats"]
    assert isinstance(stats, dict) and stats["num_running_reqs"] == 0  # the victim was aborted
    stop_launch(processes)
