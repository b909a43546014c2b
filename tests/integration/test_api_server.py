"""`kvserve serve` as a real process in front of real `kvserve launch` deployments: the official
openai client (whole and streamed), raw HTTP refusals, client disconnects that must free their
blocks, an engine that is down, and one front end over two engines sharing a prefix workload.
"""

import json
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from deploy.keys import keygen
from engine_client.errors import EngineDeadError
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    Processes,
    free_tcp_ports,
    launch,
    stop_launch,
    stop_process,
    wait_for,
    wait_http_healthy,
)
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
API_KEY = "sk-test-key"
LAUNCH_FLAGS = ("--kv-cache-memory-bytes", "16000000", "--max-model-len", "2048")
STARTUP_TIMEOUT_S = 120.0  # a loaded machine imports torch slowly
HTTP_TIMEOUT_S = 30.0
FREED_TIMEOUT_S = 10.0  # an aborted request's blocks are back long before it would have ended
LONG_MAX_TOKENS = 1900  # a generation far longer than any of these tests waits


def start_api(
    processes: Processes, name: str, engine_addresses: list[str], port: int, *extra: str
) -> str:
    """`kvserve serve --engine-address ...` as process `name`; its base URL once /health is 200."""
    args = ["serve", "--model", MODEL, "--port", str(port), "--log-level", "INFO", *extra]
    for address in engine_addresses:
        args += ["--engine-address", address]
    processes.start(name, "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"
    wait_http_healthy(processes, name, url, STARTUP_TIMEOUT_S)
    return url


def engine_stats(address: str) -> dict:
    with EngineClient(address, timeout_s=10) as client:
        return client.get_stats()  # type: ignore[return-value]


def wait_blocks_freed(address: str) -> dict:
    def idle() -> dict | None:
        stats = engine_stats(address)
        is_idle = stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0
        return stats if is_idle else None

    return wait_for(idle, FREED_TIMEOUT_S, "the engine freeing every block")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def served(module_processes: Processes, module_addresses: dict) -> Iterator[str]:
    """One engine (tiny-llama, TP 1) and a front end with an API key, shared by the module's
    tests (none needs a fresh one: each leaves the engine idle, and the one counter a test reads
    exactly, the 401s of POST /v1/completions, only that test makes); both stopped cleanly."""
    processes, addresses = module_processes, module_addresses
    launch(processes, addresses, 1, MODEL, *LAUNCH_FLAGS)
    (port,) = free_tcp_ports(1)
    url = start_api(processes, "api", [addresses["client"]], port, "--api-key", API_KEY)
    yield url
    stop_process(processes, "api")
    stop_launch(processes)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.mark.timeout(240)
def test_openai_client_gets_the_reference_tokens_whole_and_streamed(served: str) -> None:
    client, tokenizer = _client(served), ByteTokenizer()
    prompt = "The quick brown fox jumps over the lazy dog, twice over."  # 56 bytes
    expected_ids = reference_generate(
        MODEL, tokenizer.encode(prompt), SamplingParams(max_tokens=12, ignore_eos=True)
    )
    body = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model=MODEL, prompt=prompt, **body)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].text == tokenizer.decode(expected_ids)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (56, 12)
    assert whole.usage.total_tokens == 68
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **body
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the same prompt again: its 3 full blocks of 16 come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 48
    by_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), **body)
    assert by_ids.choices[0].text == whole.choices[0].text


@pytest.mark.timeout(240)
def test_openai_client_chat_batches_models_and_refusals(served: str) -> None:
    client = _client(served)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    deltas = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    assert streamed == chat.choices[0].message.content
    batch = client.completions.create(model=MODEL, prompt=["ab", "cd", "ef"], max_tokens=3)
    assert sorted(choice.index for choice in batch.choices) == [0, 1, 2]
    assert batch.usage.prompt_tokens == 6
    assert [model.id for model in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n=10000"):
        client.completions.create(model=MODEL, prompt="x", n=10000)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 2, 600])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"prompt": "x",', 400, None),
        (b'{"prompt": "x", "logit_bias": {"100000": 5}}', 400, "logit_bias"),
        (b'{"prompt": "x", "max_tokens": "8"}', 400, "max_tokens"),
        (b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
        (b'{"prompt": {"text": "x"}}', 400, "prompt"),
        (b'{"prompt": "x", "model": "other"}', 404, "model"),
        (b'{"prompt": "' + b"a" * 5_000_000 + b'"}', 413, None),
    ],
)
def test_raw_http_refusals_have_openai_shape(
    served: str, body: bytes, status: int, param: str | None
) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    response = httpx.post(f"{served}/v1/completions", content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


@pytest.mark.timeout(240)
def test_what_sdks_send_beyond_kvserves_parameters_is_served(served: str) -> None:
    """Unknown fields ignored, known ones at their defaults accepted, the developer role, and
    vLLM's /tokenize and /detokenize against the engine's max_model_len."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0)
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        store=False,
        metadata={"trace": "1"},
        response_format={"type": "text"},
        parallel_tool_calls=False,
        extra_body={"logit_bias": {}, "best_of": 1, "ignore_eos": True, "unknown_key": [1]},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    headers = {"authorization": f"Bearer {API_KEY}"}
    tokenized = httpx.post(
        f"{served}/tokenize", json={"model": MODEL, "messages": messages}, headers=headers
    ).json()
    assert tokenized["count"] == chat.usage.prompt_tokens
    assert tokenized["max_model_len"] == 2048
    text = httpx.post(
        f"{served}/detokenize", json={"tokens": tokenized["tokens"]}, headers=headers
    ).json()["prompt"]
    assert text == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


@pytest.mark.timeout(240)
def test_keys_routes_health_metrics_and_version(served: str) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{served}/v1/completions", json=body).status_code == 401
    wrong = {"authorization": "Bearer nope"}
    assert httpx.post(f"{served}/v1/completions", json=body, headers=wrong).status_code == 401
    missing = httpx.get(f"{served}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{served}/v1/completions").status_code == 405
    assert httpx.get(f"{served}/health").json() == {"engines": {_engine_of(served): True}}
    assert httpx.get(f"{served}/version").json()["version"]
    metrics = httpx.get(f"{served}/metrics").text
    assert (
        'http_requests_total{handler="/v1/completions",method="POST",status="401"} 2.0' in metrics
    )
    assert "http_request_duration_seconds_bucket" in metrics
    assert 'vllm:kv_cache_usage_perc{engine="0"} 0.0' in metrics
    good = {"authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{served}/v1/completions", json=body, headers=good).status_code == 200
    metrics = httpx.get(f"{served}/metrics").text
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count") >= 1
    assert _sample(metrics, "vllm:inter_token_latency_seconds_count") >= 2


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(f"{name} "))
    return float(line.split()[1])


def _engine_of(url: str) -> str:
    return next(iter(httpx.get(f"{url}/health").json()["engines"]))


def _raw_request(url: str, body: dict, key: str = API_KEY) -> socket.socket:
    """A POST to /v1/completions over a plain socket, so the test decides when it closes."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT_S)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {key}\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.timeout(240)
def test_clients_that_disconnect_have_their_requests_aborted(served: str) -> None:
    """Guards against a lost cancel: a whole (not streamed) completion whose client left in the
    loop turn an output arrived was collected to its end (asyncio.wait_for on Python 3.11 dropped
    the cancel), so its blocks stayed in use. Three such clients give that race three chances."""
    engine = _engine_of(served)
    long = {"prompt": "a" * 40, "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    streams = [_raw_request(served, {**long, "stream": True}) for _ in range(3)]
    for sock in streams:
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended early: {received[-500:]!r}"
            received += chunk
        assert b" 200 " in received.split(b"\r\n", 1)[0]
    assert engine_stats(engine)["num_running_reqs"] == 3
    for sock in streams:
        sock.close()
    stats = wait_blocks_freed(engine)
    assert stats["num_output_tokens"] < 3 * LONG_MAX_TOKENS // 2, stats
    wholes = [_raw_request(served, long) for _ in range(3)]  # not streamed: each client leaves
    wait_for(lambda: engine_stats(engine)["num_running_reqs"] == 3, 10, "the requests running")
    for sock in wholes:
        sock.close()
    wait_blocks_freed(engine)


@pytest.mark.timeout(120)
def test_an_engine_that_is_down_is_a_503(processes: Processes, tmp_path: Path) -> None:
    (port,) = free_tcp_ports(1)
    args = ["serve", "--model", MODEL, "--port", str(port)]
    args += ["--engine-address", f"ipc://{tmp_path}/nobody.sock"]
    processes.start("api", "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"

    def health_status() -> int | None:
        try:
            return httpx.get(f"{url}/health", timeout=10).status_code
        except httpx.TransportError:
            return None

    assert wait_for(health_status, 30, "the server answering /health") == 503
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"
    stop_process(processes, "api")


def _launch_second(processes: Processes, folder: Path) -> tuple[str, subprocess.Popen]:
    client = f"ipc://{folder}/client-b.sock"
    args = ["launch", "-tp", "1", "--model", MODEL, "--device", "cpu", "--client-address", client]
    args += ["--worker-address", f"ipc://{folder}/worker-b.sock", *LAUNCH_FLAGS]
    return client, processes.start("launch-b", "kvserve_main", args)


def _shared_prefix_run(url: str, salt: str, num_prefixes: int, per_prefix: int) -> None:
    """Requests whose prompts share one of `num_prefixes` 64-token system prompts."""
    client = _client(url)
    prompts = [
        f"system prompt {p:02d} " * 4 + f"question {i}"
        for i in range(per_prefix)
        for p in range(num_prefixes)
    ]

    def one(prompt: str) -> None:
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": salt}
        )
        assert response.usage.completion_tokens >= 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, prompts))


def _hits_and_queries(addresses: list[str]) -> list[tuple[int, int]]:
    stats = [engine_stats(address) for address in addresses]
    return [(s["prefix_cache_hits"], s["prefix_cache_queries"]) for s in stats]


def _hit_rate(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> float:
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries


@pytest.mark.timeout(360)
def test_two_engines_share_a_prefix_workload_like_one(
    processes: Processes, addresses: dict, ipc_folder: Path
) -> None:
    launch(processes, addresses, 1, MODEL, *LAUNCH_FLAGS)
    engine_b, _ = _launch_second(processes, ipc_folder)
    engine_a = addresses["client"]
    port_one, port_two = free_tcp_ports(2)
    one = start_api(processes, "api-one", [engine_a], port_one)
    two = start_api(processes, "api-two", [engine_a, engine_b], port_two)
    before = _hits_and_queries([engine_a, engine_b])
    _shared_prefix_run(one, "run-one", num_prefixes=8, per_prefix=6)
    middle = _hits_and_queries([engine_a, engine_b])
    _shared_prefix_run(two, "run-two", num_prefixes=8, per_prefix=6)
    after = _hits_and_queries([engine_a, engine_b])
    assert middle[1] == before[1], "the one-engine front end reached the second engine"
    assert all(a[1] > m[1] for a, m in zip(after, middle, strict=True)), (middle, after)
    rate_one, rate_two = _hit_rate(before, middle), _hit_rate(middle, after)
    assert rate_one > 0.5, rate_one
    assert abs(rate_one - rate_two) <= 0.05, (rate_one, rate_two)
    stop_process(processes, "api-one")
    stop_process(processes, "api-two")
    stop_process(processes, "launch-b")
    stop_launch(processes)


@pytest.mark.timeout(240)
def test_a_front_end_with_keys_launches_a_curve_engine_and_serves_through_it(
    processes: Processes, tmp_path: Path
) -> None:
    """With --curve-keys-dir, `kvserve serve` gives the engine and workers it launches their
    keys and connects as a CURVE client; a keyless client of that engine gets nothing."""
    keys_dir = tmp_path / "keys"
    keygen(keys_dir)
    http_port, client_port, worker_port, master_port = free_tcp_ports(4)
    client_address = f"tcp://127.0.0.1:{client_port}"
    url = start_api(
        processes,
        "api",
        [],
        http_port,
        "--curve-keys-dir",
        str(keys_dir),
        "--client-address",
        client_address,
        "--worker-address",
        f"tcp://127.0.0.1:{worker_port}",
        "--master-port",
        str(master_port),
        "--device",
        "cpu",
        *LAUNCH_FLAGS,
    )
    tokenizer = ByteTokenizer()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = tokenizer.decode(reference_generate(MODEL, tokenizer.encode("curve"), params))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    body = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.completions.create(model=MODEL, prompt="curve", **body).choices[0].text == (
        expected
    )
    assert "CURVE on: 2 authorized public keys" in processes.log("api")
    with (
        EngineClient(client_address, timeout_s=1.0) as keyless,
        pytest.raises((TimeoutError, EngineDeadError)),  # its handshake fails or goes unanswered
    ):
        keyless.get_stats()
    stop_process(processes, "api")
