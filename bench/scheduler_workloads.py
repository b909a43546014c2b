"""The scheduler benchmark's workloads, run alike by kvserve and by its vLLM peer; stdlib only.

Each side wraps its own Scheduler in an object with `add(prompt, max_tokens)`, `step()` (seconds
of schedule() plus update_from_output()) and `scheduler.running`; the loops here feed and time it.
"""

import argparse
import random
import statistics
from collections.abc import Callable
from typing import Any, Protocol

SAMPLED_TOKEN_ID = 7  # every step samples this; ignore_eos keeps requests going
VOCAB_SIZE = 512
WORKLOAD_FLAGS = [
    ("--max-num-seqs", 1024),
    ("--max-num-batched-tokens", 8192),
    ("--max-model-len", 4096),
    ("--block-size", 16),
    ("--num-blocks", 40000),
    ("--prompt-len", 32),
    ("--steps", 50),
    ("--mix-arrivals", 10),
    ("--mix-prompt-len", 768),
    ("--mix-warmup-steps", 30),
]
DEFAULT_DECODE_SIZES = "64,256,1024"


class SchedulerBench(Protocol):
    scheduler: Any

    def add(self, prompt: list[int], max_tokens: int) -> None: ...

    def step(self) -> float: ...


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (`--repeats` aside), the same on both sides."""
    for flag, default in WORKLOAD_FLAGS:
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument(
        "--decode-sizes", default=DEFAULT_DECODE_SIZES, help="running decode requests"
    )


def workload_keys() -> list[str]:
    """The argparse names of every flag the peer must receive, `--repeats` included."""
    return [flag[2:].replace("-", "_") for flag, _ in WORKLOAD_FLAGS] + ["repeats", "decode_sizes"]


def measure_workloads(
    new_bench: Callable[[], SchedulerBench], args: argparse.Namespace
) -> dict[str, float | int]:
    """Every workload on a fresh bench: µs per step, and the prefill mix's running requests."""
    figures: dict[str, float | int] = {}
    for num_reqs in [int(size) for size in args.decode_sizes.split(",")]:
        figures[f"decode_{num_reqs}_us_per_step"] = decode_workload(new_bench(), num_reqs, args)
    mix_us, mix_running = prefill_mix_workload(new_bench(), args)
    figures["prefill_mix_us_per_step"] = mix_us
    figures["prefill_mix_num_running_reqs"] = mix_running
    return figures


def num_decoding(bench: SchedulerBench) -> int:
    return sum(1 for request in bench.scheduler.running if request.num_output_tokens > 0)


def decode_workload(bench: SchedulerBench, num_reqs: int, args: argparse.Namespace) -> float:
    rng = random.Random(num_reqs)
    max_tokens = args.steps * args.repeats + 64
    for _ in range(num_reqs):
        bench.add([rng.randrange(1, VOCAB_SIZE) for _ in range(args.prompt_len)], max_tokens)
    while num_decoding(bench) < num_reqs:
        bench.step()
    return _median_us(bench, args, lambda: None)


def prefill_mix_workload(bench: SchedulerBench, args: argparse.Namespace) -> tuple[float, int]:
    """µs per step, and the running requests at the end (equal on both sides when in step)."""
    rng = random.Random(12345)

    def arrive() -> None:
        for _ in range(args.mix_arrivals):
            bench.add([rng.randrange(1, VOCAB_SIZE) for _ in range(args.mix_prompt_len)], 16)

    for _ in range(args.mix_warmup_steps):
        arrive()
        bench.step()
    return _median_us(bench, args, arrive), len(bench.scheduler.running)


def _median_us(
    bench: SchedulerBench, args: argparse.Namespace, arrive: Callable[[], None]
) -> float:
    """Median over `repeats` windows of the mean step time of `steps` steps, in µs."""
    windows = []
    for _ in range(args.repeats):
        total_s = 0.0
        for _ in range(args.steps):
            arrive()
            total_s += bench.step()
        windows.append(total_s / args.steps * 1e6)
    return statistics.median(windows)
