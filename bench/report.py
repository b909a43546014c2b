"""How every benchmark reports: medians over repeated runs, a printed table, and `--json FILE`.

Keys are named after what they measure (`decode_256_us_per_step`); ratios to the baseline
measured in the same run go under `ratio_` keys, and a ratio's per-round values
(bench/peer_rounds.py) under `rounds_ratio_` keys.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

DEFAULT_PEER_PYTHON = os.path.join(
    os.path.dirname(__file__), "..", "..", "peer", "vllm", "bin", "python"
)


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a timeout, a CI runner) unwind the benchmark like Ctrl-C, so that its
    finally blocks and context managers stop the processes it started instead of leaving them
    serving in the background. Call it first in a benchmark's main."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per figure; the median is reported"
    )
    return parser


def add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", choices=["vllm"], help="also run the same workload through vLLM")
    parser.add_argument(
        "--peer-python",
        default=DEFAULT_PEER_PYTHON,
        help="python of the vLLM peer environment (built by bash bench/peers/setup.sh DIR)",
    )


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """Run `fn` `repeats` times; each call returns one measurement; report the median."""
    return statistics.median(fn() for _ in range(repeats))


def time_call_s(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_peer(peer_python: str, script: str, args: list[str], timeout_s: float = 1800.0) -> dict:
    """Run `script` under the peer interpreter; it prints one JSON object as its last line."""
    if not os.path.exists(peer_python):
        sys.exit(
            f"peer python {peer_python} not found: build it with "
            "bash bench/peers/setup.sh DIR and pass --peer-python DIR/bin/python"
        )
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONHASHSEED="0",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    result = subprocess.run(
        [peer_python, script, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        sys.exit(f"peer run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(
    title: str, figures: dict[str, float | int | str | list[float]], json_path: str | None
) -> None:
    """Print the figures as an aligned table and write them to `json_path` if given."""
    print(title)
    width = max(len(key) for key in figures)
    for key, value in figures.items():
        print(f"  {key:<{width}}  {_shown(value)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
            f.write("\n")


def _shown(value: float | int | str | list[float]) -> str:
    if isinstance(value, list):
        return " ".join(_shown(item) for item in value)
    return f"{value:,.3f}" if isinstance(value, float) else str(value)
