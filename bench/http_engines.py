"""Two engines behind one HTTP front end against one: prefix-cache hit rate and throughput.

Starts engines A and B (`kvserve launch`, TP 1, CPU), a front end over A and one over A and B,
then interleaves rounds of one shared-prefix workload through each, resetting both prefix caches
before every pass. Figures are medians of per-round values and ratios.
Run: python -m bench.http_engines [--model tiny-llama] [--repeats 3] [--json FILE]
"""

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.http import HTTP_TIMEOUT_S, STARTUP_TIMEOUT_S, HttpConnection, stop_processes
from bench.report import base_parser, report
from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import UtilityCallError
from engine_core.net.endpoints import free_tcp_ports

NUM_PREFIXES = 8  # distinct shared prefixes
NUM_SUFFIXES = 8  # requests per prefix, each with its own suffix
PREFIX_LEN = 96  # tokens: 6 blocks of 16
SUFFIX_LEN = 16
MAX_TOKENS = 16
CONCURRENCY = 16  # requests in flight through one front end
KV_CACHE_MEMORY_BYTES = 32_000_000  # per engine: room for every prompt of a round
RESET_TIMEOUT_S = 30.0  # an engine refuses a reset while requests still hold blocks
RESET_RETRY_S = 0.1
# Each worker runs cpu_count torch threads; OpenMP's default spin-wait between parallel regions
# makes two replicas on a small host spin against each other (on 2 cores it cut one engine's
# tiny-llama throughput by 3.8 times and two engines' by 7), so the engines sleep instead
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"


@dataclass(frozen=True, slots=True)
class Pass:
    """One pass of the workload through one front end."""

    elapsed_s: float
    num_requests: int
    num_output_tokens: int
    num_queries: list[int]  # prompt tokens each engine looked up in its prefix cache
    num_hits: list[int]  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return sum(self.num_hits) / max(1, sum(self.num_queries))

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s


def workload(seed: int) -> list[list[int]]:
    """NUM_PREFIXES prefixes times NUM_SUFFIXES suffixes, shuffled so that prefixes interleave."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    prompts = [
        prefix + [rng.randrange(3, 250) for _ in range(SUFFIX_LEN)]
        for prefix in prefixes
        for _ in range(NUM_SUFFIXES)
    ]
    rng.shuffle(prompts)
    return prompts


def _engine_command(folder: Path, name: str, model: str, log_level: str) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    command = [kvserve, "launch", "-tp", "1", "--model", model, "--device", "cpu"]
    command += ["--client-address", f"ipc://{folder}/{name}-client.sock"]
    command += ["--worker-address", f"ipc://{folder}/{name}-worker.sock"]
    command += ["--master-port", str(free_tcp_ports(1)[0])]
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)]
    return [*command, "--log-level", log_level]


def _serve_command(addresses: list[str], model: str, port: int, log_level: str) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    command = [kvserve, "serve", "--model", model, "--port", str(port), "--log-level", log_level]
    for address in addresses:
        command += ["--engine-address", address]
    return command


def _wait_all_healthy(ports: list[int], processes: list[subprocess.Popen]) -> None:
    """Until every front end reports every one of its engines serving."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = list(ports)
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"front ends on ports {waiting} not healthy in {STARTUP_TIMEOUT_S} s"
            )
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a kvserve process exited during startup")
        try:
            answer = httpx.get(f"http://127.0.0.1:{waiting[0]}/health", timeout=2)
            if answer.status_code == 200 and all(answer.json()["engines"].values()):
                waiting.pop(0)
                continue
        except httpx.TransportError:
            pass
        time.sleep(0.2)


async def _reset(client: AsyncEngineClient) -> None:
    deadline = time.monotonic() + RESET_TIMEOUT_S
    while True:
        try:
            await client.call_utility("reset_prefix_cache")
            return
        except UtilityCallError:  # requests still hold blocks: they are finishing
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(RESET_RETRY_S)


async def _counters(engines: list[AsyncEngineClient]) -> list[tuple[int, int]]:
    """(prefix_cache_queries, prefix_cache_hits) of each engine."""
    counters = []
    for engine in engines:
        stats = await engine.call_utility("get_stats")
        if not isinstance(stats, dict):
            raise RuntimeError(f"get_stats of {engine.address} answered {stats!r}")
        counters.append((int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])))
    return counters


async def _drive(port: int, prompts: list[list[int]]) -> int:
    """Send every prompt through the front end on `port`, CONCURRENCY at a time; output tokens."""
    connections = [await HttpConnection.open(port) for _ in range(CONCURRENCY)]
    queue = list(reversed(prompts))
    num_tokens = [0]

    async def lane(connection: HttpConnection) -> None:
        while queue:
            body = {"prompt": queue.pop(), "max_tokens": MAX_TOKENS, "ignore_eos": True}
            response = await connection.post("/v1/completions", body | {"temperature": 0})
            num_tokens[0] += response["usage"]["completion_tokens"]

    try:
        await asyncio.wait_for(asyncio.gather(*(lane(c) for c in connections)), HTTP_TIMEOUT_S * 4)
    finally:
        for connection in connections:
            connection.close()
    return num_tokens[0]


async def one_pass(port: int, engines: list[AsyncEngineClient], prompts: list[list[int]]) -> Pass:
    """The workload through one front end, from empty prefix caches on every engine."""
    for engine in engines:
        await _reset(engine)
    before = await _counters(engines)
    start_s = time.perf_counter()
    num_output_tokens = await _drive(port, prompts)
    elapsed_s = time.perf_counter() - start_s
    after = await _counters(engines)
    return Pass(
        elapsed_s,
        len(prompts),
        num_output_tokens,
        [a[0] - b[0] for a, b in zip(after, before, strict=True)],
        [a[1] - b[1] for a, b in zip(after, before, strict=True)],
    )


async def _rounds(ports: dict[str, int], addresses: list[str], num_rounds: int) -> dict[str, list]:
    """Interleaved passes, the side that goes first alternating; every Pass of each side."""
    engines = [AsyncEngineClient(address, timeout_s=HTTP_TIMEOUT_S) for address in addresses]
    passes: dict[str, list[Pass]] = {"one": [], "two": []}
    try:
        for side in passes:  # warm both front ends, their connections and the models
            await one_pass(ports[side], engines, workload(seed=-1)[: CONCURRENCY * 2])
        for round_idx in range(num_rounds):
            prompts = workload(seed=round_idx)
            order = ["one", "two"] if round_idx % 2 == 0 else ["two", "one"]
            for side in order:
                passes[side].append(await one_pass(ports[side], engines, prompts))
    finally:
        for engine in engines:
            await engine.close()
    return passes


def figures(passes: dict[str, list[Pass]], model: str) -> dict[str, float | int | str]:
    one, two = passes["one"], passes["two"]
    rounds = list(zip(one, two, strict=True))
    ratios = [b.output_tokens_per_s / a.output_tokens_per_s for a, b in rounds]
    return {
        "model": model,
        "rounds": len(rounds),
        "num_cpus": len(os.sched_getaffinity(0)),
        "requests_per_round": one[0].num_requests,
        "one_engine_prefix_cache_hit_rate": statistics.median(p.hit_rate for p in one),
        "two_engine_prefix_cache_hit_rate": statistics.median(p.hit_rate for p in two),
        "two_minus_one_engine_hit_rate_points": statistics.median(
            (b.hit_rate - a.hit_rate) * 100 for a, b in rounds
        ),
        "one_engine_output_tokens_per_s": statistics.median(p.output_tokens_per_s for p in one),
        "two_engine_output_tokens_per_s": statistics.median(p.output_tokens_per_s for p in two),
        "one_engine_requests_per_s": statistics.median(p.requests_per_s for p in one),
        "two_engine_requests_per_s": statistics.median(p.requests_per_s for p in two),
        "ratio_two_engine_throughput": statistics.median(ratios),
        "ratio_two_engine_throughput_min": min(ratios),  # the spread over rounds
        "ratio_two_engine_throughput_max": max(ratios),
        "two_engine_engine_b_query_share": statistics.median(
            p.num_queries[1] / max(1, sum(p.num_queries)) for p in two
        ),
        "target_hit_rate_gap_points_max": 5.0,
    }


def main() -> None:
    parser = base_parser("one HTTP front end over two engines vs over one")
    parser.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "checksum"])
    parser.add_argument("--log-level", default="WARNING", help="of the launched processes")
    parser.add_argument(
        "--omp-wait-policy",
        default=DEFAULT_OMP_WAIT_POLICY,
        choices=["PASSIVE", "ACTIVE", "inherit"],
        help="OMP_WAIT_POLICY of the engines; inherit keeps this process's environment",
    )
    args = parser.parse_args()
    engine_env = dict(os.environ)
    if args.omp_wait_policy != "inherit":
        engine_env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    num_rounds = max(3, args.repeats)
    ports = {"one": free_tcp_ports(1)[0], "two": free_tcp_ports(1)[0]}
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvs-engines-", dir="/tmp") as tmp:
        folder = Path(tmp)
        addresses = [f"ipc://{folder}/{name}-client.sock" for name in ("a", "b")]
        try:
            for name in ("a", "b"):
                command = _engine_command(folder, name, args.model, args.log_level)
                processes.append(subprocess.Popen(command, env=engine_env))
            for side, side_addresses in (("one", addresses[:1]), ("two", addresses)):
                command = _serve_command(side_addresses, args.model, ports[side], args.log_level)
                processes.append(subprocess.Popen(command))
            _wait_all_healthy(list(ports.values()), processes)
            passes = run_async(_rounds(ports, addresses, num_rounds))
        finally:
            stop_processes(processes)
    measured = figures(passes, args.model) | {"omp_wait_policy": args.omp_wait_policy}
    title = "one front end over two engines vs over one (medians of per-round values)"
    report(title, measured, args.json)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
