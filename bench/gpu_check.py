"""The CUDA path proven on one GPU in a few minutes: the worker unit tests on cuda, the demo
workload at TP=1 and at TP=2 with both ranks on the one GPU (gloo), a capacity report, every
output compared with the CPU reference model; then real checkpoints (bench/gpu_checkpoint_checks.py)
in float32 and bfloat16 against transformers, at TP=1 and TP=2 over gloo, throughput figures
of Qwen3-0.6B's shape in bfloat16 and in FP8 (quantized here; weights kept in fp8 on devices of
compute capability 8.9 and up), and two throughput workloads in-process
(bench/gpu_throughput.py).
One line per check: PASS, FAIL or SKIP, name, detail. Exit 0 only when every check passed.
Without CUDA every check is SKIP and it exits 1: nothing was proven.
Run: `python -m bench.gpu_check [--skip CHECK] [--check-timeout-s S]`, or on a bare GPU
machine `bash bench/gpu_run.sh` (which installs what that machine lacks from .whl/).
"""

import argparse
import gc
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench import gpu_checkpoint_checks, gpu_throughput
from bench.gpu_checkpoint_checks import CheckResult, stop_launcher
from bench.report import unwind_on_sigterm
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from engine_core.service.plan import POOL_HOST_BYTES_PER_BLOCK
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from worker.attention_backends.backend import ATTENTION_BACKENDS
from worker.distributed import single_rank_group
from worker.kv_cache import (
    CudaMemory,
    allocate_kv_caches,
    memory_at_start,
    num_blocks_in_budget,
    profile_capacity,
)
from worker.models.fake.reference import ReferenceModel
from worker.models.registry import build_model, get_model_info
from worker.profiling import run_profile_step

ROOT = Path(__file__).resolve().parents[1]
WORKER_TEST_FILES = (
    "tests/unit/test_worker_kv_cache.py",
    "tests/unit/test_worker_profiling.py",
    "tests/unit/test_model_runner.py",
    "tests/unit/test_models_paged_vs_reference.py",
    "tests/unit/test_fused_kernels.py",  # compiled here, against torch's ops on the device
    "tests/unit/test_decode_graphs_cuda.py",
)
# One check may take this long. The four older files took about a minute on an H200; the
# Triton kernels' first compiles are not yet measured on a GPU.
CHECK_TIMEOUT_S = 240
DEMO_UTILIZATION = 0.3  # of the device, for the demo deployments (split between ranks sharing it)
DEMO_NUM_BLOCKS = 64  # the pool the demo runs on, as tight as `kvserve demo`'s, so it preempts
DEMO_MODEL = "tiny-llama"
DEMO_CONVERSATIONS = 8
DEMO_TURNS = 4
DEMO_MAX_TOKENS = 16  # tokens generated per turn
DEMO_STARTUP_TIMEOUT_S = 120.0  # for the engine and its ranks to be ready, profiling included
DEMO_TURN_TIMEOUT_S = 60.0  # for one turn's requests to finish
CAPACITY_MODEL = "tiny-llama"
CAPACITY_UTILIZATION = 0.5  # the capacity check fills this share of the device with KV blocks
CAPACITY_STEP_TOKENS = 2048  # the engine's default max_num_batched_tokens
ALLOCATION_SLACK = 0.01  # share of the device the allocator may round up past the budget
# The throughput workloads' own budgets (s), in place of --check-timeout-s: kvserve's warm-up and
# run, then transformers' generate(), on a checkpoint the checks before them wrote (about 20 s
# more when they were skipped). Guesses until a GPU run times them: the whole of gpu_run.sh
# should stay within 8 minutes on an H100.
THROUGHPUT_BUDGETS_S = {"throughput-equal-qwen3-0.6b": 90, "throughput-nano-vllm-qwen3-0.6b": 180}


class CheckTimeoutError(TimeoutError):
    """A check ran past --check-timeout-s."""


def check_worker_unit_tests(timeout_s: float) -> CheckResult:
    """The worker unit tests under `pytest --device cuda`, in a process of their own."""
    # one process (the ini's `-n auto` dropped), so this runs where pytest-xdist is not installed
    command = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider"]
    command += ["--device", "cuda"]
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


def demo_conversations(num_turns: int) -> Iterator[list[list[int]]]:
    """Each turn's prompts: eight conversations on two shared system prompts, growing by a user
    turn each time (the replies are left out, so the prompts need no earlier output)."""
    rng = random.Random(0)
    system_prompts = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(2)]
    histories = [list(system_prompts[c % 2]) for c in range(DEMO_CONVERSATIONS)]
    for _ in range(num_turns):
        for history in histories:
            history.extend(rng.randrange(3, 500) for _ in range(12))
        yield [list(history) for history in histories]


def launch_args(tp_size: int, folder: str) -> list[str]:
    """`kvserve launch` on cuda: capacity measured by profiling, the pool kept small."""
    return [
        "launch",
        *("-tp", str(tp_size), "--model", DEMO_MODEL, "--device", "cuda"),
        *("--client-address", f"ipc://{folder}/client.sock"),
        *("--worker-address", f"ipc://{folder}/worker.sock"),
        *("--master-port", str(free_tcp_ports(1)[0])),
        *("--gpu-memory-utilization", str(DEMO_UTILIZATION)),
        *("--num-gpu-blocks-override", str(DEMO_NUM_BLOCKS)),
        *("--max-model-len", "512", "--max-num-batched-tokens", "512", "--log-level", "INFO"),
    ]


def serve_and_compare(address: str) -> tuple[int, list[str]]:
    """Serve every turn and compare each output with the CPU reference; (requests, mismatches)."""
    torch.set_num_threads(1)  # the reference's matrices are small: more threads only contend
    reference = ReferenceModel(DEMO_MODEL, seed=0)
    params = SamplingParams(max_tokens=DEMO_MAX_TOKENS)
    num_requests, mismatches = 0, []
    with EngineClient(address, timeout_s=DEMO_STARTUP_TIMEOUT_S) as client:
        client.check_health()
        for turn, prompts in enumerate(demo_conversations(DEMO_TURNS)):
            req_ids = [f"conv{c}-turn{turn}" for c in range(len(prompts))]
            for req_id, prompt in zip(req_ids, prompts, strict=True):
                client.add_request(make_request(req_id, prompt, params))
            results = client.run_until_finished(req_ids, DEMO_TURN_TIMEOUT_S)
            for req_id, prompt in zip(req_ids, prompts, strict=True):
                result = results[req_id]
                expected = reference.generate(prompt, params)
                if result.error is not None or result.token_ids != expected:
                    mismatches.append(req_id)
            num_requests += len(req_ids)
    return num_requests, mismatches


def check_demo(tp_size: int, log_path: Path, expected_lines: list[str]) -> CheckResult:
    """The demo workload through `kvserve launch` on cuda, its outputs checked against the CPU
    reference model, and the ranks' log checked for the lines in `expected_lines`."""
    kvserve = [sys.executable, "-m", "deploy"]  # console scripts may not be installed
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-") as folder, log_path.open("wb") as log:
        launcher = subprocess.Popen(
            [*kvserve, *launch_args(tp_size, folder)], cwd=ROOT, stdout=log, stderr=log
        )
        try:
            num_requests, mismatches = serve_and_compare(f"ipc://{folder}/client.sock")
        finally:
            code = stop_launcher(launcher)
    text = log_path.read_text(errors="replace")
    if code != 0:
        return CheckResult(False, f"kvserve launch exited {code}; its log: {log_path}")
    missing = [line for line in expected_lines if line not in text]
    memory_lines = [line.split(": ", 1)[-1] for line in text.splitlines() if "memory of" in line]
    detail = (
        f"{num_requests} requests, {len(mismatches)} differ from the CPU reference; "
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
        "checkpoint-fp32-tp1": lambda: gpu_checkpoint_checks.check_accuracy(folder, 1, "float32"),
        "checkpoint-bf16-tp1": lambda: gpu_checkpoint_checks.check_accuracy(folder, 1, "bfloat16"),
        "checkpoint-fp32-tp2-one-gpu-gloo": lambda: gpu_checkpoint_checks.check_accuracy(
            folder, 2, "float32"
        ),
        "checkpoint-throughput-qwen3-0.6b": lambda: gpu_checkpoint_checks.check_throughput(folder),
        "checkpoint-throughput-fp8-qwen3-0.6b": lambda: gpu_checkpoint_checks.check_fp8_throughput(
            folder
        ),
        "throughput-equal-qwen3-0.6b": lambda: gpu_throughput.check_equal(
            folder, args.attention_backend, THROUGHPUT_BUDGETS_S["throughput-equal-qwen3-0.6b"]
        ),
        "throughput-nano-vllm-qwen3-0.6b": lambda: gpu_throughput.check_nano_vllm(
            folder,
            args.attention_backend,
            THROUGHPUT_BUDGETS_S["throughput-nano-vllm-qwen3-0.6b"],
            args.nano_vllm_sequences,
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
        gc.collect()  # what a check left on the device (a stopped one's too) is freed for the next
        torch.cuda.empty_cache()
    word = "PASS" if result.is_passed else "FAIL"
    print(f"{word} {name} {result.detail} ({time.monotonic() - start:.1f} s)", flush=True)
    return result.is_passed


def nano_vllm_sequences(text: str) -> int:
    """--nano-vllm-sequences: a count from 1 to the benchmark's sequences."""
    most = gpu_throughput.NANO_VLLM_NUM_SEQUENCES
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count from 1 to {most}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    unwind_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--skip", action="append", default=[], help="a check to skip (repeat)")
    parser.add_argument(
        "--check-timeout-s", type=int, default=CHECK_TIMEOUT_S, help="seconds per check"
    )
    parser.add_argument("--log-folder", help="where the demo logs go; default a temporary folder")
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="triton",
        help="of the throughput workloads; where it fails they fall back to blocks and say so",
    )
    parser.add_argument(
        "--nano-vllm-sequences",
        type=nano_vllm_sequences,
        default=gpu_throughput.NANO_VLLM_NUM_SEQUENCES,
        help="serve only the first N sequences of nano-vllm's benchmark (a count of sequences)",
    )
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
            run_check(name, check, THROUGHPUT_BUDGETS_S.get(name, args.check_timeout_s))
            for name, check in named.items()
            if name not in args.skip
        ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
