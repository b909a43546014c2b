"""Routing policies over several engines: hit rate, TTFT and throughput of multi-turn
conversations on shared system prompts, through one front end per policy over the same engines,
and through one front end over a single engine holding all their memory (the hit-rate reference).

Starts N engines (`kvserve launch`, fixed-time model, each prefill charged per prompt token,
KV events on), a front end per `--router-policy` over all N, and one more engine with N times the
blocks behind its own front end. Each round runs the same conversations through every side, in
an order that rotates, from empty prefix caches. Figures are medians of per-round values.
Run: python -m bench.http_engines --engines 4 [--repeats 5] [--json FILE]
"""

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from api_server.routing.kv_scorer import DEFAULT_DECODE_WEIGHT, DEFAULT_PREFILL_WEIGHT
from bench.conversations import NUM_TURNS, Conversation, workload
from bench.http import HTTP_TIMEOUT_S, STARTUP_TIMEOUT_S, stop_processes
from bench.report import base_parser, report, unwind_on_sigterm
from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import UtilityCallError
from engine_core.net.endpoints import free_tcp_ports

POLICIES = ("kv", "first-block", "least-loaded", "round-robin")
REFERENCE = "one-engine-4x"  # a single engine with every engine's blocks: the hit-rate reference
MAX_TOKENS = 16
DEFAULT_CONVERSATIONS = 32
DEFAULT_CONCURRENCY = 16  # conversations in flight through one front end
DEFAULT_BLOCKS_PER_ENGINE = 96  # 16-token blocks: the busiest system prompt outgrows one engine
DEFAULT_STEP_MS = 4.0  # the fixed-time model's device time per forward
DEFAULT_PREFILL_TOKEN_US = 60.0  # and per prompt token it computes
KV_CACHE_MEMORY_BYTES = 64_000_000  # the CPU budget; --num-gpu-blocks-override sets the blocks
RESET_TIMEOUT_S = 30.0  # an engine refuses a reset while requests still hold blocks
RESET_RETRY_S = 0.1
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"  # replicas on a small host must not spin against each other


@dataclass(frozen=True, slots=True)
class Pass:
    """One pass of the conversations through one front end."""

    elapsed_s: float
    num_output_tokens: int
    ttft_s: list[float]
    num_queries: int  # prompt tokens the engines looked up in their prefix caches
    num_hits: int  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.num_hits / max(1, self.num_queries)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


@dataclass(frozen=True, slots=True)
class Sizing:
    num_engines: int
    blocks_per_engine: int
    step_ms: float
    prefill_token_us: float
    num_conversations: int
    concurrency: int


def _engine_command(folder: Path, name: str, num_blocks: int, sizing: Sizing) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    pub_port, replay_port, master_port = free_tcp_ports(3)
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    command = [kvserve, "launch", "-tp", "1", "--model", "fixed-time", "--device", "cpu"]
    command += ["--client-address", f"ipc://{folder}/{name}-client.sock"]
    command += ["--worker-address", f"ipc://{folder}/{name}-worker.sock"]
    command += ["--master-port", str(master_port), "--max-model-len", "1024"]
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)]
    command += ["--num-gpu-blocks-override", str(num_blocks)]
    command += ["--model-step-ms", str(sizing.step_ms)]
    command += ["--model-prefill-token-us", str(sizing.prefill_token_us)]
    return [*command, "--kv-events-config", json.dumps(events), "--log-level", "WARNING"]


def _serve_command(
    addresses: list[str], policy: str, port: int, router_flags: list[str]
) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    command = [kvserve, "serve", "--model", "fixed-time", "--port", str(port)]
    command += ["--router-policy", policy, "--log-level", "WARNING", *router_flags]
    for address in addresses:
        command += ["--engine-address", address]
    return command


def _wait_ready(ports: list[int], processes: list[subprocess.Popen]) -> None:
    """Until every front end follows every one of its engines' KV events."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = list(ports)
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"front ends on ports {waiting} not ready in {STARTUP_TIMEOUT_S} s")
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a kvserve process exited during startup")
        try:
            engines = httpx.get(f"http://127.0.0.1:{waiting[0]}/router", timeout=2).json()
            if all(
                e["is_routable"] and e["is_following_kv_events"] and not e["is_kv_events_silent"]
                for e in engines["engines"]
            ):
                waiting.pop(0)
                continue
        except (httpx.TransportError, json.JSONDecodeError, KeyError):
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


async def _counters(engines: list[AsyncEngineClient]) -> tuple[int, int]:
    """(prefix_cache_queries, prefix_cache_hits) summed over the engines."""
    queries = hits = 0
    for engine in engines:
        stats = await engine.call_utility("get_stats")
        if not isinstance(stats, dict):
            raise RuntimeError(f"get_stats of {engine.address} answered {stats!r}")
        queries += int(stats["prefix_cache_queries"])
        hits += int(stats["prefix_cache_hits"])
    return queries, hits


async def _stream_one(http: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and tokens received, of one streamed completion."""
    body = {"model": "fixed-time", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    start_s = time.perf_counter()
    ttft_s: float | None = None
    num_chunks = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft_s is None:
                ttft_s = time.perf_counter() - start_s
            num_chunks += 1
    if ttft_s is None:
        raise RuntimeError(f"{url} streamed no token")
    return ttft_s, num_chunks


async def _drive(
    port: int, systems: list[list[int]], conversations: list[Conversation], concurrency: int
) -> tuple[list[float], int]:
    """Every conversation, its turns in order, `concurrency` conversations at a time."""
    url = f"http://127.0.0.1:{port}"
    queue = list(reversed(conversations))
    ttfts: list[float] = []
    num_tokens = [0]
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S * 4, limits=limits) as http:

        async def lane() -> None:
            while queue:
                conversation = queue.pop()
                for turn in range(NUM_TURNS):
                    prompt = conversation.prompt(systems, turn)
                    ttft_s, num_chunk_tokens = await _stream_one(http, url, prompt)
                    ttfts.append(ttft_s)
                    num_tokens[0] += num_chunk_tokens

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return ttfts, num_tokens[0]


async def one_pass(port: int, engines: list[AsyncEngineClient], seed: int, sizing: Sizing) -> Pass:
    """The conversations through one front end, from empty prefix caches on its engines."""
    for engine in engines:
        await _reset(engine)
    await asyncio.sleep(0.5)  # the front ends see the clears before the first request
    systems, conversations = workload(seed, sizing.num_conversations)
    before = await _counters(engines)
    start_s = time.perf_counter()
    ttfts, num_tokens = await _drive(port, systems, conversations, sizing.concurrency)
    elapsed_s = time.perf_counter() - start_s
    after = await _counters(engines)
    return Pass(elapsed_s, num_tokens, ttfts, after[0] - before[0], after[1] - before[1])


async def _rounds(
    ports: dict[str, int], addresses: dict[str, list[str]], num_rounds: int, sizing: Sizing
) -> dict[str, list[Pass]]:
    """Every side once per round, the order rotating by one each round."""
    clients = {
        side: [AsyncEngineClient(address, timeout_s=HTTP_TIMEOUT_S) for address in side_addresses]
        for side, side_addresses in addresses.items()
    }
    sides = list(ports)
    passes: dict[str, list[Pass]] = {side: [] for side in sides}
    try:
        for side in sides:  # warm each front end, its connections and the engines
            warm = dataclasses.replace(sizing, num_conversations=4)
            await one_pass(ports[side], clients[side], -1, warm)
        for round_idx in range(num_rounds):
            shift = round_idx % len(sides)
            for side in sides[shift:] + sides[:shift]:
                passes[side].append(await one_pass(ports[side], clients[side], round_idx, sizing))
    finally:
        for side_clients in clients.values():
            for client in side_clients:
                await client.close()
    return passes


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def figures(passes: dict[str, list[Pass]], sizing: Sizing) -> dict[str, float | int | str]:
    measured: dict[str, float | int | str] = {
        "engines": sizing.num_engines,
        "blocks_per_engine": sizing.blocks_per_engine,
        "model_step_ms": sizing.step_ms,
        "model_prefill_token_us": sizing.prefill_token_us,
        "rounds": len(passes["kv"]),
        "requests_per_round": sizing.num_conversations * NUM_TURNS,
        "num_cpus": len(os.sched_getaffinity(0)),
    }
    for side, side_passes in passes.items():
        key = side.replace("-", "_")
        measured[f"{key}_hit_rate"] = statistics.median(p.hit_rate for p in side_passes)
        measured[f"{key}_ttft_p50_ms"] = 1000 * statistics.median(
            _percentile(p.ttft_s, 0.5) for p in side_passes
        )
        measured[f"{key}_ttft_p99_ms"] = 1000 * statistics.median(
            _percentile(p.ttft_s, 0.99) for p in side_passes
        )
        measured[f"{key}_output_tokens_per_s"] = statistics.median(
            p.output_tokens_per_s for p in side_passes
        )
    kv = passes["kv"]
    for side in ("first-block", "least-loaded", "round-robin"):
        key = side.replace("-", "_")
        rounds = list(zip(kv, passes[side], strict=True))
        measured[f"ratio_kv_ttft_p50_to_{key}"] = statistics.median(
            _percentile(a.ttft_s, 0.5) / _percentile(b.ttft_s, 0.5) for a, b in rounds
        )
        measured[f"ratio_kv_throughput_to_{key}"] = statistics.median(
            a.output_tokens_per_s / b.output_tokens_per_s for a, b in rounds
        )
    measured["kv_minus_first_block_hit_rate_points"] = statistics.median(
        100 * (a.hit_rate - b.hit_rate) for a, b in zip(kv, passes["first-block"], strict=True)
    )
    measured["reference_minus_kv_hit_rate_points"] = statistics.median(
        100 * (b.hit_rate - a.hit_rate) for a, b in zip(kv, passes[REFERENCE], strict=True)
    )
    measured["goal_kv_minus_first_block_points_min"] = 10.0
    measured["goal_reference_minus_kv_points_max"] = 5.0
    return measured


def _parser() -> argparse.ArgumentParser:
    parser = base_parser(
        "routing policies over N engines against one engine with N times the memory"
    )
    for flag, default, helptext in (
        ("--engines", 4, "engines behind each policy's front end"),
        ("--blocks-per-engine", DEFAULT_BLOCKS_PER_ENGINE, "KV blocks of 16 tokens per engine"),
        ("--conversations", DEFAULT_CONVERSATIONS, "conversations per pass"),
        ("--concurrency", DEFAULT_CONCURRENCY, "conversations in flight per front end"),
    ):
        parser.add_argument(
            flag, type=int, default=default, help=f"{helptext}; default %(default)s"
        )
    for flag, default, helptext in (
        ("--model-step-ms", DEFAULT_STEP_MS, "fixed-time's device ms per forward"),
        ("--model-prefill-token-us", DEFAULT_PREFILL_TOKEN_US, "and us per prompt token"),
        ("--router-prefill-weight", DEFAULT_PREFILL_WEIGHT, "the kv policy's"),
        ("--router-decode-weight", DEFAULT_DECODE_WEIGHT, "the kv policy's"),
    ):
        parser.add_argument(
            flag, type=float, default=default, help=f"{helptext}; default %(default)s"
        )
    parser.add_argument(
        "--omp-wait-policy",
        default=DEFAULT_OMP_WAIT_POLICY,
        choices=["PASSIVE", "ACTIVE", "inherit"],
        help="OMP_WAIT_POLICY of the engines; inherit keeps this process's environment",
    )
    return parser


def main() -> None:
    unwind_on_sigterm()
    args = _parser().parse_args()
    for flag, value in (
        ("--engines", args.engines),
        ("--blocks-per-engine", args.blocks_per_engine),
        ("--conversations", args.conversations),
        ("--concurrency", args.concurrency),
    ):
        if value < 1:
            sys.exit(f"{flag} {value}: expected at least 1")
    sizing = Sizing(
        args.engines,
        args.blocks_per_engine,
        args.model_step_ms,
        args.model_prefill_token_us,
        args.conversations,
        args.concurrency,
    )
    engine_env = dict(os.environ)
    if args.omp_wait_policy != "inherit":
        engine_env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    num_rounds = max(1, args.repeats)
    router_flags = ["--router-prefill-weight", str(args.router_prefill_weight)]
    router_flags += ["--router-decode-weight", str(args.router_decode_weight)]
    sides = [*POLICIES, REFERENCE]
    ports = dict(zip(sides, free_tcp_ports(len(sides)), strict=True))
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvs-engines-", dir="/tmp") as tmp:
        folder = Path(tmp)
        names = [f"e{idx}" for idx in range(sizing.num_engines)]
        engines = [f"ipc://{folder}/{name}-client.sock" for name in names]
        big = f"ipc://{folder}/big-client.sock"
        addresses = {policy: engines for policy in POLICIES} | {REFERENCE: [big]}
        try:
            for name in names:
                command = _engine_command(folder, name, sizing.blocks_per_engine, sizing)
                processes.append(subprocess.Popen(command, env=engine_env))
            big_blocks = sizing.blocks_per_engine * sizing.num_engines
            command = _engine_command(folder, "big", big_blocks, sizing)
            processes.append(subprocess.Popen(command, env=engine_env))
            for side in sides:
                policy = side if side in POLICIES else "kv"  # one engine: any policy picks it
                command = _serve_command(addresses[side], policy, ports[side], router_flags)
                processes.append(subprocess.Popen(command))
            _wait_ready(list(ports.values()), processes)
            passes = run_async(_rounds(ports, addresses, num_rounds, sizing))
        finally:
            stop_processes(processes)
    measured = figures(passes, sizing) | {"omp_wait_policy": args.omp_wait_policy}
    title = f"routing policies over {sizing.num_engines} engines (medians of per-round values)"
    report(title, measured, args.json)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
