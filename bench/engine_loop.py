"""The whole engine loop against a model of known step time: steps and output tokens per second.

Starts kvserve-core and a kvserve-worker per rank (fixed-time model, CPU), keeps 64, 256 and 1,024
decodes running, and reads get_stats over --repeats slices of a window (medians reported);
ratio_model_bound = steps/s x model step time, 1.0 when the engine costs nothing.

With --kv-offload-host-bytes it runs bench/engine_loop_tiers.py's turnover workload instead, blocks
moving between the pool and a host tier every step, with the tier on and off in alternate
deployments over --rounds rounds (medians over rounds; each round's window read in slices).
"""

import argparse
import itertools
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import engine_loop_tiers
from bench.http import stop_processes
from bench.report import base_parser, report, unwind_on_sigterm
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.config import SchedulerConfig, WorkerConfig
from protocol.kv_cache_spec import bytes_per_block, cdiv
from protocol.sampling import SamplingParams
from worker.models.registry import get_model_info

MODEL = "fixed-time"
MODES = ("sync", "async")  # the step loop's: --no-async-scheduling, --async-scheduling
ASYNC_FIELD = "async_scheduling"
HEADLINE_KEY = "ratio_model_bound_async_tp2_256"
TIER_HEADLINE_KEY = "ratio_model_bound_async_tp2_256_host"  # with --kv-offload-host-bytes
PHASES = ("schedule", "encode", "transport", "update")  # get_stats' step_<phase>_s totals
DEFAULT_SIZES = (64, 256, 1024)
DEFAULT_TP_SIZES = (1, 2)
DEFAULT_WINDOW_S = 3.0
PROMPT_LEN = 8  # tokens: short, so that the batch is decodes after a few steps
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
WARMUP_STEPS = 20  # steps run with the whole batch decoding before the window opens
STEP_MARGIN = 256  # tokens beyond the window's steps, for admission, warm-up and polling
SPARE_BLOCKS = 64
STARTUP_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 120.0  # for a batch to be admitted and warmed up, or to drain after its abort
CLIENT_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 1.0
POLL_S = 0.05
# The fake model sleeps through its step as a GPU rank's host would; OpenMP's default spin-wait
# after each parallel region would instead burn the cores the engine needs.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}


def available_modes() -> list[str]:
    """The loop modes this engine has: async when SchedulerConfig has the field."""
    return list(MODES) if ASYNC_FIELD in SchedulerConfig.__struct_fields__ else ["sync"]


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip().isdigit()]
    if len(values) != len(text.split(",")) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 1")
    return values


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in MODES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected modes from {list(MODES)}")
    return names


def parse_args(argv: list[str] | None, modes_available: list[str]) -> argparse.Namespace:
    """The flags; `modes` comes back in run order, sync first (the baseline of every run)."""
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        type=_names,
        help="comma-separated step-loop modes, sync and async; sync always runs as the "
        f"baseline (default: every mode this engine has, here {','.join(modes_available)})",
    )
    parser.add_argument("--sizes", type=_ints, default=list(DEFAULT_SIZES), help="running decodes")
    parser.add_argument("--tp", type=_ints, default=list(DEFAULT_TP_SIZES), help="ranks per run")
    parser.add_argument(
        "--window-s", type=float, default=DEFAULT_WINDOW_S, help="seconds measured per size"
    )
    parser.add_argument(
        "--model-step-ms",
        type=float,
        default=WorkerConfig().model_step_ms,
        help="milliseconds each forward of the fixed-time model lasts at least",
    )
    parser.add_argument("--log-level", default="WARNING", help="of the engine and the workers")
    parser.add_argument(
        "--kv-offload-host-bytes",
        type=int,
        default=0,
        help="a host tier of this many bytes (all ranks), under a turnover workload that moves "
        "blocks every step, against the same workload with no tier; 0: the decode workload",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="--kv-offload-host-bytes: tier off/on rounds"
    )
    args = parser.parse_args(argv)
    if args.kv_offload_host_bytes < 0:
        parser.error(f"--kv-offload-host-bytes {args.kv_offload_host_bytes}: expected >= 0")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected >= 1")
    requested = args.modes or modes_available
    missing = [mode for mode in requested if mode not in modes_available]
    if missing:
        parser.error(f"--modes {','.join(missing)}: SchedulerConfig has no {ASYNC_FIELD} field")
    for name, value in (("--window-s", args.window_s), ("--model-step-ms", args.model_step_ms)):
        if not value > 0:
            parser.error(f"{name} {value}: expected > 0")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected >= 1")
    args.modes = ["sync", *(mode for mode in MODES[1:] if mode in requested)]
    return args


@dataclass(frozen=True, slots=True)
class Reading:
    """The engine's counters (totals since it started) as the client saw them at time_s."""

    time_s: float
    num_steps: int
    num_output_tokens: int
    num_preemptions: int
    phase_s: dict[str, float]  # seconds in each of PHASES

    @classmethod
    def of(cls, stats: dict, time_s: float) -> "Reading":
        return cls(
            time_s,
            int(stats["num_engine_steps"]),
            int(stats["num_output_tokens"]),
            int(stats["num_preemptions"]),
            {phase: float(stats[f"step_{phase}_s"]) for phase in PHASES},
        )


def slice_figures(before: Reading, after: Reading, step_s: float) -> dict[str, float]:
    """Rates and per-step averages between two readings."""
    elapsed_s = after.time_s - before.time_s
    num_steps = after.num_steps - before.num_steps
    if num_steps < 1 or elapsed_s <= 0:
        raise RuntimeError(f"{num_steps} engine steps in {elapsed_s:.3f} s: expected some")
    if after.num_preemptions != before.num_preemptions:
        raise RuntimeError(f"{after.num_preemptions - before.num_preemptions} preemptions")
    num_tokens = after.num_output_tokens - before.num_output_tokens
    steps_per_s = num_steps / elapsed_s
    figures = {
        "steps_per_s": steps_per_s,
        "output_tokens_per_s": num_tokens / elapsed_s,
        "output_tokens_per_step": num_tokens / num_steps,
    }
    phases_us = {
        phase: 1e6 * (after.phase_s[phase] - before.phase_s[phase]) / num_steps for phase in PHASES
    }
    figures |= {f"{phase}_us_per_step": us for phase, us in phases_us.items()}
    # the engine's own work, outside the round trip to the ranks
    figures["engine_us_per_step"] = sum(phases_us[p] for p in ("schedule", "encode", "update"))
    # the rest of each step's wall time: client input, outputs to clients, the loop itself
    figures["other_us_per_step"] = 1e6 / steps_per_s - sum(phases_us.values())
    # what the engine waits beyond the model's set time: the wire, and the ranks' CPU work
    # (batch building, sampling, and any forward work longer than the step) that it did not hide;
    # negative in the asynchronous loop when the engine's own work hides under the model's
    figures["transport_beyond_model_us_per_step"] = phases_us["transport"] - 1e6 * step_s
    figures["ratio_model_bound"] = steps_per_s * step_s
    return figures


def window_figures(readings: list[Reading], step_s: float) -> dict[str, float]:
    """The median over the window's consecutive slices of each slice's figures."""
    slices = [slice_figures(a, b, step_s) for a, b in itertools.pairwise(readings)]
    if not slices:
        raise ValueError(f"{len(readings)} readings: expected at least 2")
    return {key: statistics.median(s[key] for s in slices) for key in slices[0]}


def keyed(figures: dict[str, float], mode: str, tp_size: int, size: int) -> dict[str, float]:
    """`<mode>_tp<N>_<size>_<name>`, and the ratio as `ratio_model_bound_<mode>_tp<N>_<size>`."""
    run = f"{mode}_tp{tp_size}_{size}"
    return {
        f"ratio_model_bound_{run}" if name == "ratio_model_bound" else f"{run}_{name}": value
        for name, value in figures.items()
    }


def max_tokens_for(window_s: float, step_s: float) -> int:
    """Enough tokens that no request finishes before the window closes: a step lasts at least
    step_s, so the window holds at most window_s / step_s of them."""
    max_model_len = get_model_info(MODEL, BLOCK_SIZE).max_model_len
    steps = math.ceil(window_s / step_s) + WARMUP_STEPS + STEP_MARGIN
    return min(steps, max_model_len - PROMPT_LEN)


def kv_cache_memory_bytes(num_reqs: int, max_tokens: int, tp_size: int) -> int:
    """A rank's KV budget: every request at its longest, so that nothing is preempted."""
    groups = get_model_info(MODEL, BLOCK_SIZE).kv_cache_groups
    num_blocks = num_reqs * cdiv(PROMPT_LEN + max_tokens, BLOCK_SIZE) + SPARE_BLOCKS
    return num_blocks * bytes_per_block(groups, tp_size)


def loop_flags(mode: str, modes_available: list[str]) -> list[str]:
    """The engine flag that picks the step loop; none while the engine has only one."""
    if "async" not in modes_available:
        return []
    return ["--async-scheduling" if mode == "async" else "--no-async-scheduling"]


@dataclass(frozen=True, slots=True)
class Sizing:
    """What the engine and every rank of one deployment must agree on."""

    tp_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int  # per rank
    model_step_ms: float


def commands(
    folder: Path, sizing: Sizing, loop: list[str], master_port: int, tier: tuple[str, ...] = ()
) -> list[list[str]]:
    """Each rank's kvserve-worker, then kvserve-core (stop_processes stops the last first, and
    the engine stops its ranks itself)."""
    scripts = Path(sys.executable).parent
    shared = ["-tp", str(sizing.tp_size), "--block-size", str(BLOCK_SIZE)]
    shared += ["--max-num-batched-tokens", str(sizing.max_num_batched_tokens)]
    shared += ["--kv-cache-memory-bytes", str(sizing.kv_cache_memory_bytes)]
    worker = [str(scripts / "kvserve-worker"), *shared, "--model", MODEL, "--device", "cpu"]
    worker += ["--model-step-ms", str(sizing.model_step_ms), "--master-port", str(master_port)]
    worker += ["--engine-address", f"ipc://{folder}/worker.sock"]
    engine = [str(scripts / "kvserve-core"), *shared, *loop, *tier]
    engine += ["--max-num-seqs", str(sizing.max_num_seqs)]
    engine += ["--client-address", f"ipc://{folder}/client.sock"]
    engine += ["--worker-address", f"ipc://{folder}/worker.sock"]
    ranks = [
        [*worker, "--rank", str(rank), "--local-rank", str(rank)] for rank in range(sizing.tp_size)
    ]
    return [*ranks, engine]


def start_deployment(
    folder: Path, sizing: Sizing, loop: list[str], log_level: str, tier: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    (master_port,) = free_tcp_ports(1)
    # each rank takes its share of the cores, as `kvserve launch` gives it
    env = os.environ | WORKER_ENV | {"LOCAL_WORLD_SIZE": str(sizing.tp_size)}
    processes: list[subprocess.Popen] = []
    try:
        for command in commands(folder, sizing, loop, master_port, tier):
            processes.append(subprocess.Popen([*command, "--log-level", log_level], env=env))
    except OSError:
        stop_processes(processes)
        raise
    return processes


def wait_ready(client: EngineClient, processes: list[subprocess.Popen]) -> None:
    """Until the engine answers check_health, which it does once every rank is ready."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        exited = [p.args[0] for p in processes if p.poll() is not None]  # type: ignore[index]
        if exited:
            raise RuntimeError(f"{exited} exited during startup")
        try:
            client.call_utility("check_health", timeout_s=HEALTH_TIMEOUT_S)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine at {client.address} not ready in {STARTUP_TIMEOUT_S} s"
                ) from None


def drain_until(client: EngineClient, deadline_s: float, batch: frozenset[str]) -> None:
    """Read outputs until time.monotonic() reaches deadline_s; a request of `batch`, which must
    stay full, finishing is an error."""
    while (remaining_s := deadline_s - time.monotonic()) > 0:
        for output in client.poll_outputs(min(remaining_s, POLL_S)):
            if output.finish_reason is not None and output.req_id in batch:
                raise RuntimeError(
                    f"{output.req_id} finished ({output.finish_reason}, {output.error}) while "
                    "its batch was measured: expected every request to run on"
                )


def get_stats(client: EngineClient) -> dict:
    stats = client.call_utility("get_stats")
    if not isinstance(stats, dict):
        raise RuntimeError(f"get_stats answered {stats!r}, expected a dict")
    return stats


def settle(
    client: EngineClient, is_done: Callable[[dict], bool], what: str, batch: frozenset[str]
) -> int:
    """Read outputs until is_done(get_stats); the engine's step count then."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stats = get_stats(client)
        if is_done(stats):
            return int(stats["num_engine_steps"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done in {SETTLE_TIMEOUT_S} s: {stats}")
        drain_until(client, time.monotonic() + POLL_S, batch)


def measure_size(
    client: EngineClient, size: int, max_tokens: int, window_s: float, num_slices: int
) -> list[Reading]:
    """Run `size` decodes, warm up, read the counters at each slice of the window, abort."""
    rng = random.Random(size)
    vocab_size = get_model_info(MODEL, BLOCK_SIZE).vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req_ids = [f"decode-{size}-{idx}" for idx in range(size)]
    batch = frozenset(req_ids)
    for req_id in req_ids:
        prompt = [rng.randrange(3, vocab_size) for _ in range(PROMPT_LEN)]
        client.add_request(make_request(req_id, prompt, params))
    warm = settle(client, has_running(size), f"admitting {size} requests", batch) + WARMUP_STEPS
    settle(client, lambda s: s["num_engine_steps"] >= warm, "warming up", batch)
    readings = [Reading.of(get_stats(client), time.monotonic())]
    for slice_idx in range(1, num_slices + 1):
        drain_until(client, readings[0].time_s + window_s * slice_idx / num_slices, batch)
        readings.append(Reading.of(get_stats(client), time.monotonic()))
    client.abort(req_ids)
    settle(client, has_running(0), f"aborting {size} requests", frozenset())
    return readings


def has_running(num_reqs: int) -> Callable[[dict], bool]:
    """Whether get_stats shows exactly num_reqs running and none waiting."""
    return lambda stats: stats["num_running_reqs"] == num_reqs and stats["num_waiting_reqs"] == 0


def check_model_held(figures: dict[str, float], step_ms: float, what: str) -> None:
    """Each synchronous round trip holds one forward, which lasts at least step_ms: less means
    the ranks ran another step time than --model-step-ms."""
    if figures["transport_us_per_step"] < 1000 * step_ms:
        raise RuntimeError(
            f"{what}: {figures['transport_us_per_step']:.0f} us per round trip, expected at "
            f"least the model step of {1000 * step_ms:.0f} us: the ranks ran another step time"
        )


def run_deployment(
    mode: str, tp_size: int, args: argparse.Namespace, modes_available: list[str]
) -> dict[str, float]:
    """One engine and its ranks in one mode, each size of args.sizes measured in turn."""
    max_tokens = max_tokens_for(args.window_s, args.model_step_ms / 1000)
    num_seqs = max(args.sizes)
    kv_bytes = kv_cache_memory_bytes(num_seqs, max_tokens, tp_size)
    batched = max(MAX_NUM_BATCHED_TOKENS, num_seqs)
    sizing = Sizing(tp_size, num_seqs, batched, kv_bytes, args.model_step_ms)
    loop = loop_flags(mode, modes_available)
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvs-loop-", dir="/tmp") as folder:
        processes = start_deployment(Path(folder), sizing, loop, args.log_level)
        try:
            with EngineClient(f"ipc://{folder}/client.sock", CLIENT_TIMEOUT_S) as client:
                wait_ready(client, processes)
                for size in args.sizes:
                    readings = measure_size(client, size, max_tokens, args.window_s, args.repeats)
                    measured = window_figures(readings, args.model_step_ms / 1000)
                    if mode == "sync":
                        check_model_held(measured, args.model_step_ms, f"sync TP={tp_size} {size}")
                    figures |= keyed(measured, mode, tp_size, size)
        finally:
            stop_processes(processes)
    return figures


TIER_SIDES = ("no_tier", "host")


def measure_turnover(
    client: EngineClient, size: int, window_s: float, num_slices: int
) -> tuple[list[Reading], dict[str, float]]:
    """Keep `size` turns running, warm up until the batch and the cache have turned over, read
    the counters at each slice of the window, abort; also the blocks moved per step."""
    turns = engine_loop_tiers.Turns(client, MODEL, BLOCK_SIZE, size)
    turns.fill()
    warm_steps = WARMUP_STEPS + 4 * engine_loop_tiers.TURN_TOKENS
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while int(get_stats(client)["num_engine_steps"]) < warm_steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{size} turns not warmed up in {SETTLE_TIMEOUT_S} s")
        turns.drain_until(time.monotonic() + POLL_S, POLL_S)
    first = get_stats(client)
    readings = [Reading.of(first, time.monotonic())]
    for slice_idx in range(1, num_slices + 1):
        turns.drain_until(readings[0].time_s + window_s * slice_idx / num_slices, POLL_S)
        last = get_stats(client)
        readings.append(Reading.of(last, time.monotonic()))
    turns.abort()
    settle(client, has_running(0), f"aborting {size} turns", frozenset())
    return readings, engine_loop_tiers.moved_per_step(first, last)


def run_turnover(
    mode: str, tp_size: int, size: int, side: str, args: argparse.Namespace, modes: list[str]
) -> dict[str, float]:
    """One deployment of `size` turning-over requests, with the host tier on or off."""
    kv_bytes = engine_loop_tiers.kv_cache_memory_bytes(MODEL, BLOCK_SIZE, size, tp_size)
    sizing = Sizing(tp_size, size, max(MAX_NUM_BATCHED_TOKENS, size), kv_bytes, args.model_step_ms)
    tier = ("--kv-offload-host-bytes", str(args.kv_offload_host_bytes)) if side == "host" else ()
    with tempfile.TemporaryDirectory(prefix="kvs-loop-", dir="/tmp") as folder:
        processes = start_deployment(
            Path(folder), sizing, loop_flags(mode, modes), args.log_level, tier
        )
        try:
            with EngineClient(f"ipc://{folder}/client.sock", CLIENT_TIMEOUT_S) as client:
                wait_ready(client, processes)
                readings, moved = measure_turnover(client, size, args.window_s, args.repeats)
        finally:
            stop_processes(processes)
    figures = window_figures(readings, args.model_step_ms / 1000) | moved
    if mode == "sync":
        check_model_held(figures, args.model_step_ms, f"sync TP={tp_size} {size} {side}")
    return figures


def run_tier_rounds(args: argparse.Namespace, modes: list[str]) -> dict[str, float]:
    """Each mode, TP size and size: the tier off and on in alternate deployments, --rounds
    times; the medians over rounds, and the median of each round's on/off ratio."""
    measured: dict[str, float] = {}
    for mode in args.modes:
        for tp_size in args.tp:
            for size in args.sizes:
                rounds: list[dict[str, dict[str, float]]] = []
                for _ in range(args.rounds):
                    rounds.append(
                        {
                            side: run_turnover(mode, tp_size, size, side, args, modes)
                            for side in TIER_SIDES
                        }
                    )
                run = f"{mode}_tp{tp_size}_{size}"
                for side in TIER_SIDES:
                    for name in rounds[0][side]:
                        value = statistics.median(r[side][name] for r in rounds)
                        key = (
                            f"ratio_model_bound_{run}_{side}"
                            if name == "ratio_model_bound"
                            else f"{run}_{side}_{name}"
                        )
                        measured[key] = value
                per_round = [
                    r["host"]["ratio_model_bound"] / r["no_tier"]["ratio_model_bound"]
                    for r in rounds
                ]
                measured[f"ratio_host_over_no_tier_{run}"] = statistics.median(per_round)
                measured[f"{run}_min_round_host_over_no_tier"] = min(per_round)
    return measured


def summary(
    measured: dict[str, float], args: argparse.Namespace, modes_available: list[str]
) -> dict[str, float | int | str]:
    """The headline first, then every ratio, the run's settings, and every figure."""
    ratios = {key: value for key, value in measured.items() if key.startswith("ratio_")}
    headline = {key: ratios.pop(key) for key in (HEADLINE_KEY, TIER_HEADLINE_KEY) if key in ratios}
    settings: dict[str, float | int | str] = {
        "modes_run": ",".join(args.modes),
        "modes_available": ",".join(modes_available),
        "model": MODEL,
        "model_step_ms": args.model_step_ms,
        "window_s": args.window_s,
        "slices_per_window": args.repeats,
        "prompt_len": PROMPT_LEN,
        "max_tokens": max_tokens_for(args.window_s, args.model_step_ms / 1000),
        "num_cpus": len(os.sched_getaffinity(0)),
        "kv_offload_host_bytes": args.kv_offload_host_bytes,
    }
    others = {key: value for key, value in measured.items() if not key.startswith("ratio_")}
    return headline | ratios | settings | others


def main(argv: list[str] | None = None) -> None:
    unwind_on_sigterm()
    modes_available = available_modes()
    args = parse_args(argv, modes_available)
    measured: dict[str, float] = {}
    if args.kv_offload_host_bytes:
        measured = run_tier_rounds(args, modes_available)
        title = (
            f"engine loop with a host tier of {args.kv_offload_host_bytes} bytes, blocks moving "
            f"every step, against no tier ({args.rounds} rounds, a {args.model_step_ms} ms step)"
        )
        report(title, summary(measured, args, modes_available), args.json)
        return
    for mode in args.modes:
        for tp_size in args.tp:
            measured |= run_deployment(mode, tp_size, args, modes_available)
    title = (
        f"engine loop against a {args.model_step_ms} ms model step "
        f"(medians over {args.repeats} slices of each {args.window_s} s window)"
    )
    report(title, summary(measured, args, modes_available), args.json)


if __name__ == "__main__":
    main()
