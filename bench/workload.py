"""Workload: fixed requests run by the engine's Scheduler through ModelRunners on 1..N ranks.

Each rank process drives its own in-process EngineCore (the real Scheduler, no sockets) over its
ModelRunner; every rank samples the same tokens, so the copies stay in lockstep and only the models'
all-reduces cross processes. Ranks are spawned and joined against a deadline; none is left alive.
"""

import queue
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from engine_core.core import EngineCore
from engine_core.net.endpoints import free_tcp_ports
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.distributed import TPGroup, destroy_tp_group, init_tp_group, single_rank_group
from worker.model_runner import ModelRunner, build_model_runner
from worker.models.registry import get_model_info, resolve_dtypes

JOIN_TIMEOUT_S = 10.0
MAX_STEPS = 100_000  # a workload still unfinished after this many steps is stuck


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
    check_invariants: bool = False  # walk the scheduler's and runner's invariants every step
    reserve_full_prompt: bool = False  # admit chunk by chunk, so tight pools preempt prefills too
    async_scheduling: bool = False  # in-process ranks step in lockstep: the synchronous loop
    encoder_prompts: list[list[int]] | None = None  # each request's encoder input (tiny-encdec)
    attention_backend: str = "auto"  # a checkpoint's (worker/attention_backends/backend.py)
    kv_cache_dtype: str = "auto"  # auto: the compute dtype


@dataclass
class RankResult:
    rank: int
    outputs: dict[int, list[int]]  # request handle (1, 2, ... in prompt order) -> generated tokens
    num_steps: int
    num_preemptions: int
    num_hit_tokens: int  # prompt tokens served from the prefix cache, recomputations included
    runner_s: float  # wall time inside execute_model, all steps
    prepare_s: float  # of which batch building, slot mapping and context indices
    model_s: float
    sample_s: float
    step_tokens: list[int] = field(default_factory=list)  # scheduled tokens per step


class TimedRunner:
    """The EngineCore's executor on one rank: runs the ModelRunner and adds up where time went."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.runner_s = 0.0
        self.prepare_s = 0.0
        self.model_s = 0.0
        self.sample_s = 0.0
        self.step_tokens: list[int] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.runner.execute_model(scheduler_output)
        self.runner_s += time.perf_counter() - start
        timings = self.runner.timings
        self.prepare_s += timings.prepare_s
        self.model_s += timings.model_s
        self.sample_s += timings.sample_s
        self.step_tokens.append(scheduler_output.total_num_scheduled_tokens)
        return output


def engine_config(workload: Workload, model_max_len: int) -> EngineConfig:
    """The workload's limits; sequences are capped at the longest one it can produce."""
    longest = max(
        len(prompt) + params.max_tokens
        for prompt, params in zip(workload.prompts, workload.sampling_params, strict=True)
    )
    scheduler = SchedulerConfig(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=min(longest, model_max_len),
        reserve_full_prompt=workload.reserve_full_prompt,
        async_scheduling=workload.async_scheduling,
    )
    cache = CacheConfig(
        block_size=workload.block_size, enable_prefix_caching=workload.enable_prefix_caching
    )
    return EngineConfig(
        check_invariants=workload.check_invariants, cache=cache, scheduler=scheduler
    ).checked()


def build_rank(
    workload: Workload,
    tp_group: TPGroup,
    device: torch.device,
    executor_type: type[TimedRunner] = TimedRunner,  # a subclass may record more of each step
) -> tuple[EngineCore, TimedRunner]:
    """This rank's ModelRunner and an EngineCore over it, with every request queued in order."""
    _, kv_dtype = resolve_dtypes(workload.model, workload.dtype, workload.kv_cache_dtype, device)
    info = get_model_info(workload.model, workload.block_size, kv_dtype)
    kv_cache_config = KVCacheConfig(workload.num_blocks, info.kv_cache_groups)
    worker_config = WorkerConfig(
        rank=tp_group.rank,
        tp_size=tp_group.tp_size,
        model=workload.model,
        dtype=workload.dtype,
        block_size=workload.block_size,
        seed=workload.seed,
        attention_backend=workload.attention_backend,
        kv_cache_dtype=workload.kv_cache_dtype,
        max_model_len=engine_config(workload, info.max_model_len).scheduler.max_model_len,
    )
    runner = build_model_runner(worker_config, kv_cache_config, tp_group, device)
    runner.check_each_step = workload.check_invariants
    executor = executor_type(runner)
    config = engine_config(workload, info.max_model_len)
    core = EngineCore(config, kv_cache_config, info, executor)
    requests = zip(workload.prompts, workload.sampling_params, strict=True)
    for idx, (prompt, params) in enumerate(requests):
        encoder = None if workload.encoder_prompts is None else workload.encoder_prompts[idx]
        request = EngineCoreRequest(
            str(idx + 1),
            pack_int32(prompt),
            params,
            float(idx),
            encoder_token_ids=None if encoder is None else pack_int32(encoder),
        )
        rejection = core.add_request(request)
        if rejection is not None:
            raise ValueError(f"request {idx + 1} rejected: {rejection.outputs[0].error}")
    return core, executor


def run_to_completion(core: EngineCore, max_steps: int = MAX_STEPS) -> dict[int, list[int]]:
    """Step until every request finished and the workers forgot it; tokens by request handle."""
    scheduler = core.scheduler
    handles = {req_id: request.handle for req_id, request in scheduler.requests.items()}
    outputs: dict[int, list[int]] = {handle: [] for handle in handles.values()}
    num_steps = 0
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        if num_steps >= max_steps:
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        for client_outputs in core.step().values():
            for output in client_outputs.outputs:
                outputs[handles[output.req_id]].extend(output.new_token_ids)
        num_steps += 1
    return outputs


def run_workload(workload: Workload, tp_group: TPGroup, device: torch.device) -> RankResult:
    """Run every request to completion on this rank and time the runner's parts."""
    core, executor = build_rank(workload, tp_group, device)
    outputs = run_to_completion(core)
    executor.runner.check_invariants()
    stats = core.get_stats()
    return RankResult(
        rank=tp_group.rank,
        outputs=outputs,
        num_steps=int(stats["num_steps"]),
        num_preemptions=int(stats["num_preemptions"]),
        num_hit_tokens=int(stats["prefix_cache_hits"]),
        runner_s=executor.runner_s,
        prepare_s=executor.prepare_s,
        model_s=executor.model_s,
        sample_s=executor.sample_s,
        step_tokens=executor.step_tokens,
    )


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


def run_tensor_parallel(workload: Workload, tp_size: int, timeout_s: float) -> list[RankResult]:
    """Run the workload on tp_size spawned ranks; results in rank order; raises on a failed rank."""
    if tp_size == 1:
        return [run_workload(workload, single_rank_group(), torch.device("cpu"))]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_tcp_ports(1)[0]
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
