"""StepRecord: one engine step's shape and time as the runner saw it (StepRecorder records
them), and what a run's decode steps come to: the median step at the largest decode batch, that
step over its bandwidth floor (the weights and the KV cache it reads, at the card's assumed
bandwidth) and its kernel launches. Arithmetic only: bench/gpu_throughput.py runs the GPU.
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from bench.workload import TimedRunner
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.model_runner import ModelRunner

# Peak memory bandwidth by card, from the vendor's data sheets (H100 SXM's HBM3, H200's HBM3e);
# a card named by neither has no floor. The floor assumes every byte moves at this rate.
BANDWIDTH_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
COPY_KERNEL_PREFIXES = ("Memcpy", "Memset")  # CUDA events of the profiler that launch no kernel


@dataclass(slots=True)
class StepRecord:
    """One step as the runner saw it."""

    num_reqs: int
    num_tokens: int
    num_context_tokens: int  # positions the step's attention reads, its own tokens included
    seconds: float  # execute_model: inputs, forward and sampling, the sampled ids back on the host
    is_profiled: bool = False  # run under torch.profiler, so its time is left out

    @property
    def is_decode_only(self) -> bool:
        """One token for each of its requests, and at least one request (a step may carry only
        finished ids)."""
        return self.num_tokens == self.num_reqs > 0


def device_bandwidth_bytes_per_s(device_name: str) -> float | None:
    """The assumed peak bandwidth of the card named `device_name`; None for another card."""
    matches = [
        bandwidth for card, bandwidth in BANDWIDTH_BYTES_PER_S.items() if card in device_name
    ]
    return matches[0] if len(matches) == 1 else None


def kv_bytes_per_token(kv_cache_groups: list[KVCacheGroupSpec], tp_size: int = 1) -> int:
    """K and V bytes of one context position over every layer of one rank."""
    return sum(
        len(group.layer_names) * group.spec.page_size_bytes(tp_size) // group.spec.block_size
        for group in kv_cache_groups
    )


def bandwidth_floor_s(weight_bytes: int, kv_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """The least time a step can take that reads every weight and `kv_bytes` of cache once."""
    return (weight_bytes + kv_bytes) / bandwidth_bytes_per_s


def count_kernels(cuda_event_names: list[str]) -> tuple[int, int]:
    """(kernel launches, copies and memsets) among the profiler's CUDA events of one step."""
    num_copies = sum(name.startswith(COPY_KERNEL_PREFIXES) for name in cuda_event_names)
    return len(cuda_event_names) - num_copies, num_copies


def step_shape(scheduler_output: SchedulerOutput) -> tuple[int, int, int]:
    """(requests, scheduled tokens, context positions read) of one step."""
    scheduled = np.frombuffer(scheduler_output.num_scheduled_tokens, dtype="<i4")
    cached = scheduler_output.scheduled_cached_reqs.num_computed_tokens
    computed = [r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs]
    computed += np.frombuffer(cached, dtype="<i4").tolist()
    num_context = int(scheduled.sum()) + sum(computed)
    return len(scheduled), scheduler_output.total_num_scheduled_tokens, num_context


@dataclass(frozen=True, slots=True)
class DecodeSummary:
    """A run's decode-only steps at its largest decode batch."""

    batch_size: int  # the largest batch of a decode-only step
    num_steps: int  # decode-only steps at that batch, the profiled one left out
    median_s: float  # of the step with the median time (the upper one of an even count)
    median_context_tokens: int  # of that step
    median_floor_ratio: float | None  # step time over its floor, median over those steps


def decode_summary(
    records: list[StepRecord], weight_bytes: int, kv_per_token: int, bandwidth: float | None
) -> DecodeSummary:
    """The decode-only steps at the run's largest decode batch, against their bandwidth floors."""
    decode = [r for r in records if r.is_decode_only and not r.is_profiled]
    if not decode:
        raise ValueError(f"no decode-only step among {len(records)} steps")
    batch_size = max(r.num_reqs for r in decode)
    at_batch = sorted((r for r in decode if r.num_reqs == batch_size), key=lambda r: r.seconds)
    middle = at_batch[len(at_batch) // 2]
    ratio = None
    if bandwidth is not None:
        ratio = statistics.median(
            r.seconds
            / bandwidth_floor_s(weight_bytes, kv_per_token * r.num_context_tokens, bandwidth)
            for r in at_batch
        )
    return DecodeSummary(
        batch_size, len(at_batch), middle.seconds, middle.num_context_tokens, ratio
    )


class StepRecorder(TimedRunner):
    """TimedRunner that also records each step's shape and time (bench.workload builds it)."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.records: list[StepRecord] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = super().execute_model(scheduler_output)
        seconds = time.perf_counter() - start
        self.records.append(StepRecord(*step_shape(scheduler_output), seconds))
        return output
