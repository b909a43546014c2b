"""Several ModelRunners fed the same steps by one engine, so their replies and logits can be
compared step by step: the graph runner's tests (CPU, interpreted) and CUDA tests share it."""

import msgspec
import torch

from bench.workload import Workload, engine_config
from engine_core.core import EngineCore
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner
from worker.models.registry import get_model_info
from worker.sampler import SampleBatch, Sampler


class LogitsRecorder:
    """A runner's sampler that keeps a copy of every step's logits."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor, batch: SampleBatch) -> torch.Tensor:
        self.logits.append(logits.clone())
        return self.sampler.sample(logits, batch)


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Record the runner's logits from now on: the list each step's are appended to."""
    recorder = LogitsRecorder(runner.sampler)
    runner.sampler = recorder  # type: ignore[assignment]
    return recorder.logits


class LockstepRunners:
    """The engine's executor: every step runs on each runner; the first one's reply goes back."""

    def __init__(self, runners: list[ModelRunner]) -> None:
        self.runners = runners
        self.outputs: list[list[ModelRunnerOutput]] = []  # per step, each runner's (untimed)
        self.decode_batches: list[int] = []  # requests of each decode-only step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        counts = unpack_int32(scheduler_output.num_scheduled_tokens)
        if counts and set(counts) == {1} and not scheduler_output.scheduled_new_reqs:
            self.decode_batches.append(len(counts))
        outputs = [runner.execute_model(scheduler_output) for runner in self.runners]
        self.outputs.append([msgspec.structs.replace(out, forward_s=0.0) for out in outputs])
        return outputs[0]


def run_in_lockstep(work: Workload, runners: list[ModelRunner]) -> LockstepRunners:
    """Run the workload's requests to completion on every runner at once (one schedule)."""
    info = get_model_info(work.model, work.block_size, work.dtype)
    executor = LockstepRunners(runners)
    config = engine_config(work, info.max_model_len)
    core = EngineCore(config, KVCacheConfig(work.num_blocks, info.kv_cache_groups), info, executor)
    requests = zip(work.prompts, work.sampling_params, strict=True)
    for idx, (prompt, params) in enumerate(requests):
        request = EngineCoreRequest(str(idx + 1), pack_int32(prompt), params, float(idx))
        rejection = core.add_request(request)
        assert rejection is None, f"request {idx + 1} rejected"
    while core.scheduler.has_unfinished_requests() or core.scheduler.has_finished_requests():
        core.step()
    return executor
