"""Workload: a fixed set of requests run through ModelRunners on 1..N tensor-parallel ranks.

Each rank process runs its own ScriptedScheduler copy; since every rank samples the same tokens,
the copies stay in lockstep and only the models' all-reduces cross processes. Ranks are started with
torch.multiprocessing's spawn method and joined against a deadline; none is left alive.
"""

import queue
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from bench.scripted_scheduler import ScriptedScheduler, run_to_completion
from protocol.config import WorkerConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.distributed import TPGroup, destroy_tp_group, init_tp_group, single_rank_group
from worker.model_runner import build_model_runner
from worker.models.registry import get_model_info

JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Workload:
    model: str
    block_size: int
    num_blocks: int
    prompts: list[list[int]]
    sampling_params: list[SamplingParams]
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    seed: int = 0
    check_invariants: bool = False  # walk the runner's invariants every step (tests)


@dataclass
class RankResult:
    rank: int
    outputs: dict[int, list[int]]  # req_id -> generated tokens
    num_steps: int
    num_preemptions: int
    num_hit_tokens: int
    runner_s: float  # wall time inside execute_model, all steps
    prepare_s: float  # of which batch building, slot mapping and context indices
    model_s: float
    sample_s: float
    step_tokens: list[int] = field(default_factory=list)  # scheduled tokens per step


def run_workload(workload: Workload, tp_group: TPGroup, device: torch.device) -> RankResult:
    """Run every request to completion on this rank and time the runner's parts."""
    info = get_model_info(workload.model, workload.block_size, workload.dtype)
    scheduler = ScriptedScheduler(
        info,
        workload.num_blocks,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_num_seqs=workload.max_num_seqs,
        enable_prefix_caching=workload.enable_prefix_caching,
    )
    for req_id, (prompt, params) in enumerate(
        zip(workload.prompts, workload.sampling_params, strict=True)
    ):
        scheduler.add_request(req_id + 1, prompt, params)
    config = WorkerConfig(
        rank=tp_group.rank,
        tp_size=tp_group.tp_size,
        model=workload.model,
        dtype=workload.dtype,
        block_size=workload.block_size,
        seed=workload.seed,
    )
    runner = build_model_runner(config, scheduler.kv_cache_config(), tp_group, device)
    runner.check_each_step = workload.check_invariants
    result = RankResult(tp_group.rank, {}, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)

    def execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = runner.execute_model(scheduler_output)
        result.runner_s += time.perf_counter() - start
        result.prepare_s += runner.timings.prepare_s
        result.model_s += runner.timings.model_s
        result.sample_s += runner.timings.sample_s
        result.step_tokens.append(scheduler_output.total_num_scheduled_tokens)
        return output

    result.outputs = run_to_completion(scheduler, execute)
    runner.check_invariants()
    result.num_steps = scheduler.step_id
    result.num_preemptions = scheduler.num_preemptions
    result.num_hit_tokens = scheduler.num_hit_tokens
    return result


def rank_main(
    rank: int, tp_size: int, master_port: int, workload: Workload, results: mp.Queue
) -> None:
    """One spawned rank: join the group, run the workload, report, leave the group."""
    torch.set_num_threads(1)  # ranks share the machine's cores
    device = torch.device("cpu")
    group = init_tp_group(rank, tp_size, "127.0.0.1", master_port, 60.0, device)
    try:
        results.put(run_workload(workload, group, device))
    finally:
        destroy_tp_group(group)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_tensor_parallel(workload: Workload, tp_size: int, timeout_s: float) -> list[RankResult]:
    """Run the workload on tp_size spawned ranks; results in rank order; raises on a failed rank."""
    if tp_size == 1:
        return [run_workload(workload, single_rank_group(), torch.device("cpu"))]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=rank_main, args=(rank, tp_size, port, workload, results), name=f"worker-{rank}"
        )
        for rank in range(tp_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, tp_size, time.monotonic() + timeout_s)
    finally:
        _stop(procs)


def _collect(procs: list, results: mp.Queue, tp_size: int, deadline: float) -> list[RankResult]:
    collected: dict[int, RankResult] = {}
    while len(collected) < tp_size:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(set(range(tp_size)) - set(collected))} did not report in time"
            )
        try:
            result = results.get(timeout=0.2)
            collected[result.rank] = result
        except queue.Empty:
            failed = [p.name for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank processes {failed} failed") from None
    return [collected[rank] for rank in range(tp_size)]


def _stop(procs: list) -> None:
    """Join each rank against a deadline, then terminate, then kill."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
