"""Added cost of the HTTP front end (`kvserve serve`) over the ZeroMQ client, on one engine.

Starts `kvserve launch` and `kvserve serve` in front of it, then interleaves rounds A B A B: A
drives the engine with AsyncEngineClient, B with /v1/completions over a keep-alive HTTP/1.1
connection. Each round measures one-at-a-time latency and requests per second at a fixed
concurrency; the figures are medians of per-round values. Run: python -m bench.http [--json FILE]
"""

import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.report import base_parser, report, unwind_on_sigterm
from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.request import make_request
from engine_core.net.endpoints import free_tcp_ports
from protocol.sampling import SamplingParams

MODEL = "checksum"  # the cheapest model: the front end's share of each request shows most
PROMPT_LEN = 32
MAX_TOKENS = 8
NUM_LATENCY_REQS = 40  # per round, one at a time
NUM_THROUGHPUT_REQS = 128  # per round, CONCURRENCY at a time
CONCURRENCY = 16
STARTUP_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0  # a process's drain after SIGTERM, before it is killed
KILL_TIMEOUT_S = 10.0
TARGET_ADDED_LATENCY_MS = 1.0


def _prompts(rng: random.Random, num_prompts: int) -> list[list[int]]:
    """Random prompts: no two share a first block, so the prefix cache favours neither side."""
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_LEN)] for _ in range(num_prompts)]


class HttpConnection:
    """One keep-alive HTTP/1.1 connection with a minimal client, so that the figures measure the
    server rather than a client library's own overhead."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> "HttpConnection":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n\r\n"
        self.writer.write(head.encode() + data)
        headers = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), HTTP_TIMEOUT_S)
        if not headers.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"front end answered {headers[:200]!r}")
        length = next(
            int(line.split(b":", 1)[1])
            for line in headers.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        return json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        self.writer.close()


class Sides:
    """The two ways into one engine: its ZeroMQ client (A) and HTTP connections (B)."""

    def __init__(self, client: AsyncEngineClient, connections: list[HttpConnection]) -> None:
        self.client = client
        self.connections = connections
        self.params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def zmq_one(self, req_id: str, prompt: list[int], _: int) -> None:
        outputs = [o async for o in self.client.generate(make_request(req_id, prompt, self.params))]
        if sum(len(o.new_token_ids) for o in outputs) != MAX_TOKENS:
            raise RuntimeError(f"{req_id} ended early: {outputs[-1]}")

    async def http_one(self, req_id: str, prompt: list[int], lane: int) -> None:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        response = await self.connections[lane].post("/v1/completions", body)
        if response["usage"]["completion_tokens"] != MAX_TOKENS:
            raise RuntimeError(f"{req_id} ended early: {response}")


async def _latency_ms(send: object, prompts: list[list[int]], tag: str) -> float:
    """Median milliseconds of one request at a time."""
    latencies = []
    for idx, prompt in enumerate(prompts):
        start = time.perf_counter()
        await send(f"{tag}-{idx}", prompt, 0)  # type: ignore[operator]
        latencies.append((time.perf_counter() - start) * 1000)
    return statistics.median(latencies)


async def _requests_per_s(send: object, prompts: list[list[int]], tag: str) -> float:
    queue = list(enumerate(prompts))

    async def lane(lane_idx: int) -> None:
        while queue:
            idx, prompt = queue.pop()
            await send(f"{tag}-{idx}", prompt, lane_idx)  # type: ignore[operator]

    start = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(CONCURRENCY)))
    return len(prompts) / (time.perf_counter() - start)


async def _rounds(client_address: str, port: int, num_rounds: int) -> dict[str, float | int]:
    rng = random.Random(0)
    client = AsyncEngineClient(client_address, timeout_s=HTTP_TIMEOUT_S)
    connections = [await HttpConnection.open(port) for _ in range(CONCURRENCY)]
    sides = Sides(client, connections)
    per_round: dict[str, list[float]] = {key: [] for key in ("zl", "hl", "zt", "ht")}
    try:
        await _latency_ms(sides.zmq_one, _prompts(rng, 8), "warm-zmq")  # connections, caches
        await _latency_ms(sides.http_one, _prompts(rng, 8), "warm-http")
        for round_idx in range(num_rounds):
            tag = f"r{round_idx}"
            per_round["zl"].append(
                await _latency_ms(sides.zmq_one, _prompts(rng, NUM_LATENCY_REQS), tag + "zl")
            )
            per_round["hl"].append(
                await _latency_ms(sides.http_one, _prompts(rng, NUM_LATENCY_REQS), tag + "hl")
            )
            per_round["zt"].append(
                await _requests_per_s(sides.zmq_one, _prompts(rng, NUM_THROUGHPUT_REQS), tag + "zt")
            )
            per_round["ht"].append(
                await _requests_per_s(
                    sides.http_one, _prompts(rng, NUM_THROUGHPUT_REQS), tag + "ht"
                )
            )
    finally:
        for connection in connections:
            connection.close()
        await client.close()
    return _figures(per_round, num_rounds)


def _figures(per_round: dict[str, list[float]], num_rounds: int) -> dict[str, float | int]:
    latency_ratios = [h / z for h, z in zip(per_round["hl"], per_round["zl"], strict=True)]
    added_ms = [h - z for h, z in zip(per_round["hl"], per_round["zl"], strict=True)]
    throughput_ratios = [z / h for h, z in zip(per_round["ht"], per_round["zt"], strict=True)]
    return {
        "rounds": num_rounds,
        "zmq_latency_ms": statistics.median(per_round["zl"]),
        "http_latency_ms": statistics.median(per_round["hl"]),
        "http_added_latency_ms": statistics.median(added_ms),
        "zmq_requests_per_s": statistics.median(per_round["zt"]),
        "http_requests_per_s": statistics.median(per_round["ht"]),
        "ratio_http_overhead": statistics.median(latency_ratios),
        "ratio_zmq_over_http_requests_per_s": statistics.median(throughput_ratios),
        "target_http_added_latency_ms_max": TARGET_ADDED_LATENCY_MS,
    }


def _start(folder: Path, port: int, log_level: str) -> list[subprocess.Popen]:
    """`kvserve launch` (checksum, TP 1, CPU) and `kvserve serve` in front of it."""
    kvserve = str(Path(sys.executable).parent / "kvserve")
    client_address = f"ipc://{folder}/client.sock"
    launch = [kvserve, "launch", "-tp", "1", "--model", MODEL, "--device", "cpu"]
    launch += ["--client-address", client_address, "--worker-address", f"ipc://{folder}/w.sock"]
    launch += ["--kv-cache-memory-bytes", "64000000", "--log-level", log_level]
    serve = [kvserve, "serve", "--model", MODEL, "--engine-address", client_address]
    serve += ["--port", str(port), "--log-level", log_level]
    return [subprocess.Popen(launch), subprocess.Popen(serve)]


def _wait_healthy(port: int, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            sys.exit("kvserve launch or kvserve serve exited during startup")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the front end on port {port} was not healthy in {STARTUP_TIMEOUT_S} s")


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """Terminate each process, the last started first (front ends before the engines they use);
    kill one that outlives its deadline. Raises if one survives even that."""
    survivors = []
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                survivors.append(process.pid)
    if survivors:
        raise RuntimeError(f"processes {survivors} outlived SIGKILL by {KILL_TIMEOUT_S} s")


def main() -> None:
    unwind_on_sigterm()
    parser = base_parser("HTTP front end vs ZeroMQ client on one engine")
    parser.add_argument("--log-level", default="WARNING", help="of the launched processes")
    args = parser.parse_args()
    num_rounds = max(5, args.repeats)
    port = free_tcp_ports(1)[0]
    with tempfile.TemporaryDirectory(prefix="kvs-http-", dir="/tmp") as folder:
        processes = _start(Path(folder), port, args.log_level)
        try:
            _wait_healthy(port, processes)
            figures = run_async(_rounds(f"ipc://{folder}/client.sock", port, num_rounds))
        finally:
            stop_processes(processes)
    report(
        "HTTP front end over the ZeroMQ client (medians of per-round values)", figures, args.json
    )  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
