"""The CUDA path proven on one GPU in under five minutes: the worker unit tests on cuda, the demo
workload at TP=1 and at TP=2 with both ranks on the one GPU (gloo), and a capacity report, every
output compared with the CPU reference model. One line per check: PASS, FAIL or SKIP, name, detail.
Exit 0 only when every check passed. Without CUDA every check is SKIP and it exits 1: nothing was
proven. Run: `python -m bench.gpu_check [--skip CHECK] [--check-timeout-s S]`.
"""

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from deploy.demo import DemoSettings, check_against_reference, run_workload
from deploy.launch import Deployment, free_tcp_port, worker_configs
from engine_core.client import EngineClient, RequestResult
from engine_core.plan import POOL_HOST_BYTES_PER_BLOCK
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from worker.distributed import single_rank_group
from worker.kv_cache import (
    CudaMemory,
    allocate_kv_caches,
    memory_at_start,
    num_blocks_in_budget,
    profile_capacity,
)
from worker.models.registry import build_model, get_model_info
from worker.profiling import run_profile_step

ROOT = Path(__file__).resolve().parents[1]
WORKER_TEST_FILES = (
    "tests/unit/test_worker_kv_cache.py",
    "tests/unit/test_worker_profiling.py",
    "tests/unit/test_model_runner.py",
    "tests/unit/test_models_paged_vs_reference.py",
)
CHECK_TIMEOUT_S = 150  # one check may take this long; the four take about a minute on an H200
DEMO_UTILIZATION = 0.3  # of the device, for the demo deployments (split between ranks sharing it)
DEMO_NUM_BLOCKS = 64  # the pool the demo runs on, as tight as `kvserve demo`'s, so it preempts
DEMO_HANDSHAKE_TIMEOUT_S = 120.0
CAPACITY_MODEL = "tiny-llama"
CAPACITY_UTILIZATION = 0.5  # the capacity check fills this share of the device with KV blocks
CAPACITY_STEP_TOKENS = 2048  # the engine's default max_num_batched_tokens
ALLOCATION_SLACK = 0.01  # share of the device the allocator may round up past the budget


@dataclass(frozen=True)
class CheckResult:
    is_passed: bool
    detail: str


class CheckTimeoutError(TimeoutError):
    """A check ran past --check-timeout-s."""


def check_worker_unit_tests(timeout_s: float) -> CheckResult:
    """The worker unit tests under `pytest --device cuda`, in a process of their own."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", "cuda"]
    done = subprocess.run(
        [*command, *WORKER_TEST_FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = done.stdout.strip().splitlines() or ["no output"]
    if done.returncode != 0:
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        return CheckResult(False, f"pytest exited {done.returncode}: {failed or lines[-5:]}")
    return CheckResult(True, lines[-1])


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr (and so its spawned children's logs) to `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("wb") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def cuda_demo_configs(
    settings: DemoSettings, folder: str
) -> tuple[EngineConfig, list[WorkerConfig]]:
    """`kvserve demo`'s deployment on cuda: capacity measured by profiling, pool kept small."""
    engine = EngineConfig(
        tp_size=settings.tp_size,
        client_address=f"ipc://{folder}/client.sock",
        worker_address=f"ipc://{folder}/worker.sock",
        handshake_timeout_s=DEMO_HANDSHAKE_TIMEOUT_S,
        cache=CacheConfig(
            gpu_memory_utilization=DEMO_UTILIZATION, num_gpu_blocks_override=DEMO_NUM_BLOCKS
        ),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=512),
    ).checked()
    base = WorkerConfig(model=settings.model, device="cuda", master_port=free_tcp_port())
    return engine, worker_configs(engine, base)


def serve_demo_workload(
    address: str, settings: DemoSettings
) -> list[tuple[list[int], RequestResult]]:
    with EngineClient(address, timeout_s=DEMO_HANDSHAKE_TIMEOUT_S) as client:
        client.check_health()
        with Progress(disable=True) as progress:
            return run_workload(client, settings, progress)


def check_demo(tp_size: int, log_path: Path, expected_lines: list[str]) -> CheckResult:
    """The demo workload on cuda, its outputs checked against the CPU reference model, and the
    ranks' logs checked for the device, backend and capacity lines in `expected_lines`."""
    settings = DemoSettings(tp_size=tp_size)
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-") as folder, stderr_to(log_path):
        engine_config, workers = cuda_demo_configs(settings, folder)
        deployment = Deployment(engine_config, workers, "INFO")
        deployment.start()
        try:
            done = serve_demo_workload(engine_config.client_address, settings)
        finally:
            code = deployment.stop()
    if code != 0:
        return CheckResult(False, f"the deployment exited {code}; its log: {log_path}")
    mismatches = check_against_reference(done, settings)
    log = log_path.read_text(errors="replace")
    missing = [line for line in expected_lines if line not in log]
    memory_lines = [line.split(": ", 1)[-1] for line in log.splitlines() if "memory of" in line]
    detail = (
        f"{len(done)} requests, {len(mismatches)} differ from the CPU reference; "
        f"missing log lines {missing}; {memory_lines[:tp_size]}"
    )
    return CheckResult(not mismatches and not missing, detail)


def check_capacity() -> CheckResult:
    """Profile tiny-llama on cuda:0, allocate every block the budget holds, run the profiling
    step again beside them, and check the device stays within the utilization asked for."""
    device = torch.device("cuda", 0)
    memory = CudaMemory(device)
    start = memory_at_start(memory)
    info = get_model_info(CAPACITY_MODEL, block_size=16)
    model = build_model(CAPACITY_MODEL, single_rank_group(), device)

    def step() -> int:
        return run_profile_step(model, info, 0, 1, device, CAPACITY_STEP_TOKENS)

    split = profile_capacity(memory, start, step, CAPACITY_UTILIZATION)
    num_blocks = num_blocks_in_budget(info.kv_cache_groups, 1, split.kv_budget_bytes)
    caches = allocate_kv_caches(KVCacheConfig(num_blocks, info.kv_cache_groups), 1, device)
    step()  # a full step with the whole cache in place must still fit
    torch.cuda.synchronize(device)
    free_bytes, total_bytes = memory.mem_get_info()
    used = (total_bytes - free_bytes) / total_bytes
    del caches
    is_passed = split.weights_bytes > 0 and used <= CAPACITY_UTILIZATION + ALLOCATION_SLACK
    pool_mib = num_blocks * POOL_HOST_BYTES_PER_BLOCK / 2**20
    detail = (
        f"{split.describe()}; {num_blocks} blocks (pool bookkeeping {pool_mib:.0f} MiB of host "
        f"memory); device {used:.1%} used with them allocated, asked {CAPACITY_UTILIZATION:.0%}"
    )
    return CheckResult(is_passed, detail)


def checks(args: argparse.Namespace, folder: Path) -> dict[str, Callable[[], CheckResult]]:
    return {
        "worker-unit-tests-cuda": lambda: check_worker_unit_tests(args.check_timeout_s - 10),
        "demo-tp1-cuda": lambda: check_demo(
            1, folder / "demo-tp1.log", ["memory of cuda:0 for 1 ranks"]
        ),
        "demo-tp2-one-gpu-gloo": lambda: check_demo(
            2,
            folder / "demo-tp2.log",
            ["over gloo (2 ranks on cuda:0)", "memory of cuda:0 for 2 ranks"],
        ),
        "capacity": check_capacity,  # last: it fills half the device in this process
    }


def run_check(name: str, check: Callable[[], CheckResult], timeout_s: int) -> bool:
    """Run one check under an alarm; print its line; whether it passed."""

    def on_alarm(signum: int, frame: object) -> None:
        raise CheckTimeoutError(f"ran past {timeout_s} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    start = time.monotonic()
    try:
        result = check()
    except Exception as exc:  # the boundary of one check: report it and go on to the next
        result = CheckResult(False, f"{type(exc).__name__}: {exc}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    word = "PASS" if result.is_passed else "FAIL"
    print(f"{word} {name} {result.detail} ({time.monotonic() - start:.1f} s)", flush=True)
    return result.is_passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--skip", action="append", default=[], help="a check to skip (repeat)")
    parser.add_argument(
        "--check-timeout-s", type=int, default=CHECK_TIMEOUT_S, help="seconds per check"
    )
    parser.add_argument("--log-folder", help="where the demo logs go; default a temporary folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-check-") as scratch:
        folder = Path(args.log_folder or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        named = checks(args, folder)
        unknown = sorted(set(args.skip) - set(named))
        if unknown:
            parser.error(f"--skip {unknown}: expected names from {sorted(named)}")
        if not torch.cuda.is_available():
            for name in named:
                print(f"SKIP {name} no CUDA device is visible to torch {torch.__version__}")
            print("gpu_check proved nothing on this machine: run it where a CUDA device is")
            return 1
        print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        results = [
            run_check(name, check, args.check_timeout_s)
            for name, check in named.items()
            if name not in args.skip
        ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
