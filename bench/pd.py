"""Disaggregated prefill and decode against colocated engines: TTFT, TPOT, throughput and goodput
of a prefill-heavy mixed workload arriving as a Poisson stream.

Sides, each behind its own front end (`kvserve serve`, router policy kv):
- pd: one prefill engine and one decode engine (`--kv-role prefill` / `--kv-role decode`);
- colocated: two engines that serve requests whole.
All four engines run the fixed-time model, whose forward costs --model-step-ms plus
--model-prefill-token-us per prompt token computed: a long prompt admitted beside running
decodes stretches their steps, which P/D keeps apart.

The workload: --requests requests at --rate per second (exponential gaps), a --long-fraction of
them with --long-tokens prompts and the rest with --short-tokens, each generating --max-tokens
(ignore_eos). Every round runs the same workload through each side, the order rotating, from
empty prefix caches. Per request: TTFT (send to first token) and TPOT (first to last token over
the tokens after the first); per side and round: p50 and p99 of both, output tokens per second,
and goodput (requests per second meeting TTFT <= --slo-ttft-s and TPOT <= --slo-tpot-ms).
Figures are medians of the per-round values; `ratio_*` compare pd with colocated (above 1 means
pd is better). `pd_decode_prompt_tokens_per_request` says how much prefill work P/D left on the
decode engine: the prompt tokens it computed per request (at most a block each when every pull
lands; a whole prompt where one failed).

Why the defaults stand for a GPU deployment: an 8B model on an H100 decodes a batch step in
about 12 ms and prefills some 15-20k tokens a second, hence 12 ms a forward and 60 us a prompt
token (16.7k tokens/s). The mix is a retrieval or summarising service's: 30% of requests bring
a 4,096-token document (246 ms of prefill, two 2,048-token chunks), the rest a 256-token chat
turn, and every answer is 32 tokens, so prefill is most of the work. At 6 requests a second the
one prefill engine is busy about 60% of the time and each colocated engine spends a quarter of
its time in prompt tokens: a colocated decode shares steps with whatever chunks land on its
engine while it runs, the ones that meet two or three long prompts stretch their mean TPOT to
twice the step or more, while a P/D decode step computes at most one block of each admitted
prompt (its last tokens, about 1 ms). The TPOT SLO, 25 ms, is about twice the unloaded step; the
TTFT SLO, 1 s, four long prefills. The engines move pages as --kv-transport says (auto: through
NIXL where it is installed, else shared memory). 96 requests make a pass of about 16 s, so
--repeats 5 takes about 4 minutes. 4,096 blocks hold the decode engine's running requests at the
queue's worst.
Run: python -m bench.pd [--repeats 5] [--json FILE]
"""

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.http import HTTP_TIMEOUT_S, STARTUP_TIMEOUT_S, stop_processes
from bench.report import base_parser, report
from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import UtilityCallError
from engine_core.net.endpoints import free_tcp_ports

SIDES = ("pd", "colocated")
MODEL = "fixed-time"
VOCAB_LOW, VOCAB_HIGH = 3, 500
KV_CACHE_MEMORY_BYTES = 64_000_000  # the CPU budget; --num-gpu-blocks-override sets the blocks
RESET_TIMEOUT_S = 60.0  # a prefill engine refuses a reset while it holds blocks for transfers
RESET_RETRY_S = 0.2
PERCENTILES = (("p50", 0.5), ("p99", 0.99))


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    rate_per_s: float
    long_fraction: float
    long_tokens: int
    short_tokens: int
    max_tokens: int
    step_ms: float
    prefill_token_us: float
    num_blocks: int
    slo_ttft_s: float
    slo_tpot_s: float
    kv_transport: str = "auto"  # the P/D engines' --kv-transport

    def arrivals(self, seed: int) -> list[tuple[float, list[int]]]:
        """(send time after the start, prompt) per request, the same for every side."""
        rng = random.Random(seed)
        now, requests = 0.0, []
        for _ in range(self.num_requests):
            now += rng.expovariate(self.rate_per_s)
            is_long = rng.random() < self.long_fraction
            length = self.long_tokens if is_long else self.short_tokens
            requests.append((now, [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]))
        return requests


@dataclass(frozen=True, slots=True)
class Served:
    ttft_s: float
    tpot_s: float
    num_tokens: int


def _engine_command(folder: Path, name: str, role: str, workload: Workload) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    pub_port, replay_port, master_port = free_tcp_ports(3)
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    max_model_len = max(workload.long_tokens, workload.short_tokens) + workload.max_tokens + 16
    command = [kvserve, "launch", "-tp", "1", "--model", MODEL, "--device", "cpu"]
    command += ["--client-address", f"ipc://{folder}/{name}-client.sock"]
    command += ["--worker-address", f"ipc://{folder}/{name}-worker.sock"]
    command += ["--master-port", str(master_port), "--max-model-len", str(max_model_len)]
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)]
    command += ["--num-gpu-blocks-override", str(workload.num_blocks), "--kv-role", role]
    command += ["--model-step-ms", str(workload.step_ms)]
    command += ["--model-prefill-token-us", str(workload.prefill_token_us)]
    command += ["--kv-transport", workload.kv_transport]
    return [*command, "--kv-events-config", json.dumps(events), "--log-level", "WARNING"]


def _serve_command(addresses: list[str], port: int) -> list[str]:
    kvserve = str(Path(sys.executable).parent / "kvserve")
    command = [kvserve, "serve", "--model", MODEL, "--port", str(port)]
    command += ["--router-policy", "kv", "--log-level", "WARNING"]
    for address in addresses:
        command += ["--engine-address", address]
    return command


def _wait_ready(ports: dict[str, int], processes: list[subprocess.Popen]) -> None:
    """Until each front end routes to all its engines (and the pd one pairs its two)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = list(ports.items())
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"front ends {waiting} not ready in {STARTUP_TIMEOUT_S} s")
        if any(process.poll() is not None for process in processes):
            raise RuntimeError("a kvserve process exited during startup")
        side, port = waiting[0]
        try:
            engines = httpx.get(f"http://127.0.0.1:{port}/router", timeout=2).json()["engines"]
            roles = {engine["kv_role"] for engine in engines}
            is_paired = side != "pd" or roles == {"prefill", "decode"}
            if is_paired and all(e["is_routable"] and e["is_following_kv_events"] for e in engines):
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
        except UtilityCallError:  # requests (or held transfers) still hold blocks
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(RESET_RETRY_S)


async def _stream_one(
    http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> Served:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    start_s = time.perf_counter()
    first_s: float | None = None
    num_chunks = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first_s is None:
                first_s = time.perf_counter()
            num_chunks += 1
    end_s = time.perf_counter()
    if first_s is None:
        raise RuntimeError(f"{url} streamed no token")
    tpot_s = (end_s - first_s) / max(1, num_chunks - 1)
    return Served(first_s - start_s, tpot_s, num_chunks)


async def one_pass(
    port: int, engines: list[AsyncEngineClient], seed: int, workload: Workload
) -> tuple[list[Served], float]:
    """The workload through one front end from empty caches: each request and the elapsed s."""
    for engine in engines:
        await _reset(engine)
    await asyncio.sleep(0.5)  # the front end sees the clears before the first request
    url = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=workload.num_requests)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S * 4, limits=limits) as http:
        start_s = time.perf_counter()

        async def arrive(at_s: float, prompt: list[int]) -> Served:
            await asyncio.sleep(max(0.0, start_s + at_s - time.perf_counter()))
            return await _stream_one(http, url, prompt, workload.max_tokens)

        served = await asyncio.gather(
            *(arrive(at_s, prompt) for at_s, prompt in workload.arrivals(seed))
        )
        return list(served), time.perf_counter() - start_s


async def _computed_prompt_tokens(engine: AsyncEngineClient) -> int:
    """Prompt tokens the engine has computed since it started (looked up, less cache hits)."""
    stats = await engine.call_utility("get_stats")
    assert isinstance(stats, dict), stats
    return int(stats["prefix_cache_queries"]) - int(stats["prefix_cache_hits"])


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def pass_figures(served: list[Served], elapsed_s: float, workload: Workload) -> dict[str, float]:
    figures = {}
    for name, fraction in PERCENTILES:
        figures[f"ttft_{name}_s"] = _percentile([one.ttft_s for one in served], fraction)
        figures[f"tpot_{name}_ms"] = 1000 * _percentile([one.tpot_s for one in served], fraction)
    figures["output_tokens_per_s"] = sum(one.num_tokens for one in served) / elapsed_s
    good = [
        one
        for one in served
        if one.ttft_s <= workload.slo_ttft_s and one.tpot_s <= workload.slo_tpot_s
    ]
    figures["goodput_requests_per_s"] = len(good) / elapsed_s
    return figures


async def _rounds(
    ports: dict[str, int], addresses: dict[str, list[str]], num_rounds: int, workload: Workload
) -> dict[str, list[dict[str, float]]]:
    clients = {
        side: [AsyncEngineClient(address, timeout_s=HTTP_TIMEOUT_S) for address in side_addresses]
        for side, side_addresses in addresses.items()
    }
    per_round: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        warm = dataclasses.replace(workload, num_requests=min(4, workload.num_requests))
        for side in SIDES:  # warm each front end, its connections and the engines
            await one_pass(ports[side], clients[side], -1, warm)
        for round_idx in range(num_rounds):
            shift = round_idx % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                engines = clients[side]
                before = await _computed_prompt_tokens(engines[-1])
                served, elapsed_s = await one_pass(ports[side], engines, round_idx, workload)
                round_figures = pass_figures(served, elapsed_s, workload)
                if side == "pd":  # what the decode engine's steps carried of the prompts
                    computed = await _computed_prompt_tokens(engines[-1]) - before
                    round_figures["decode_prompt_tokens_per_request"] = computed / len(served)
                per_round[side].append(round_figures)
    finally:
        for side_clients in clients.values():
            for client in side_clients:
                await client.close()
    return per_round


def figures(
    per_round: dict[str, list[dict[str, float]]], workload: Workload
) -> dict[str, float | int | str]:
    """Medians of the per-round figures per side, and pd's ratios against colocated."""
    out: dict[str, float | int | str] = {
        "requests": workload.num_requests,
        "rate_per_s": workload.rate_per_s,
        "long_fraction": workload.long_fraction,
        "long_tokens": workload.long_tokens,
        "short_tokens": workload.short_tokens,
        "max_tokens": workload.max_tokens,
        "kv_transport": workload.kv_transport,
        "rounds": len(per_round["pd"]),
    }
    medians = {
        side: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for side, rounds in per_round.items()
    }
    for side, values in medians.items():
        out |= {f"{side}_{key}": value for key, value in values.items()}
    pd, colocated = medians["pd"], medians["colocated"]
    for key in ("tpot_p99_ms", "tpot_p50_ms", "ttft_p99_s", "ttft_p50_s"):  # lower is better
        out[f"ratio_{key}"] = colocated[key] / pd[key] if pd[key] else float("inf")
    for key in ("output_tokens_per_s", "goodput_requests_per_s"):  # higher is better
        out[f"ratio_{key}"] = pd[key] / colocated[key] if colocated[key] else float("inf")
    return out


def _parser() -> argparse.ArgumentParser:
    parser = base_parser("P/D (1 prefill + 1 decode engine) against 2 colocated engines")
    for flag, default, helptext in (
        ("--requests", 96, "requests per pass"),
        ("--long-tokens", 4096, "prompt tokens of a long request"),
        ("--short-tokens", 256, "prompt tokens of a short request"),
        ("--max-tokens", 32, "tokens each request generates"),
        ("--blocks", 4096, "KV blocks of 16 tokens per engine"),
    ):
        parser.add_argument(
            flag, type=int, default=default, help=f"{helptext}; default %(default)s"
        )
    for flag, default, helptext in (
        ("--rate", 6.0, "requests per second (Poisson)"),
        ("--long-fraction", 0.3, "share of long prompts"),
        ("--model-step-ms", 12.0, "fixed-time's device ms per forward"),
        ("--model-prefill-token-us", 60.0, "and us per prompt token it computes"),
        ("--slo-ttft-s", 1.0, "goodput's TTFT bound"),
        ("--slo-tpot-ms", 25.0, "goodput's TPOT bound"),
    ):
        parser.add_argument(
            flag, type=float, default=default, help=f"{helptext}; default %(default)s"
        )
    parser.add_argument(
        "--kv-transport",
        choices=["auto", "builtin", "nixl"],
        default="auto",
        help="how the P/D engines move pages (NIXL where installed, under auto); default auto",
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    for flag, value in (
        ("--requests", args.requests),
        ("--long-tokens", args.long_tokens),
        ("--short-tokens", args.short_tokens),
        ("--max-tokens", args.max_tokens),
        ("--blocks", args.blocks),
    ):
        if value < 1:
            sys.exit(f"{flag} {value}: expected at least 1")
    if not args.rate > 0 or not 0 <= args.long_fraction <= 1:
        sys.exit(f"--rate {args.rate} must be > 0 and --long-fraction {args.long_fraction} in 0..1")
    workload = Workload(
        args.requests,
        args.rate,
        args.long_fraction,
        args.long_tokens,
        args.short_tokens,
        args.max_tokens,
        args.model_step_ms,
        args.model_prefill_token_us,
        args.blocks,
        args.slo_ttft_s,
        args.slo_tpot_ms / 1000,
        args.kv_transport,
    )
    ports = dict(zip(SIDES, free_tcp_ports(len(SIDES)), strict=True))
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvs-pd-", dir="/tmp") as tmp:
        folder = Path(tmp)
        engines = {"prefill": "prefill", "decode": "decode", "c0": "both", "c1": "both"}
        address = {name: f"ipc://{folder}/{name}-client.sock" for name in engines}
        addresses = {
            "pd": [address["prefill"], address["decode"]],
            "colocated": [address["c0"], address["c1"]],
        }
        try:
            for name, role in engines.items():
                processes.append(subprocess.Popen(_engine_command(folder, name, role, workload)))
            for side in SIDES:
                processes.append(subprocess.Popen(_serve_command(addresses[side], ports[side])))
            _wait_ready(ports, processes)
            per_round = run_async(_rounds(ports, addresses, max(1, args.repeats), workload))
        finally:
            stop_processes(processes)
    title = "P/D against colocated engines (medians of per-round values)"
    report(title, figures(per_round, workload), args.json)


if __name__ == "__main__":
    main()
