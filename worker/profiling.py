"""The profiling step: before the real KV cache exists, the model runs one step of
max_num_batched_tokens dummy tokens over a small throwaway cache, so the peak memory of the
largest step the engine may schedule can be measured; then the decode graphs, where a rank has
them, are captured once on a throwaway runner, so that their memory is counted too. No sockets;
every rank of a group runs it. A checkpoint on the CPU needs no profiling step: its KV budget is
a share of the host's available memory once the weights are loaded (`cpu_kv_budget_bytes`).
"""

import logging
import os

import torch

from protocol.buffers import pack_int32
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import (
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    bytes_per_block,
    cdiv,
)
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, ModelInfo, NewRequestData, SchedulerOutput
from worker.distributed import TPGroup
from worker.graph_runner import decode_buckets, graph_refusal, uses_step_buffers
from worker.kv_cache import (
    GIB,
    MIN_NUM_BLOCKS,
    CudaMemory,
    DeviceMemory,
    MemoryAtStart,
    allocate_kv_caches,
    num_blocks_in_budget,
    profile_capacity,
)
from worker.model_runner import ModelRunner
from worker.models.hf.decoder import HFDecoder
from worker.models.model import Model
from worker.step_buffers import StepLimits

logger = logging.getLogger(__name__)

PROFILE_TOKEN_ID = 1  # any id inside the vocabulary: the values do not change the memory used
# Share of the host's available memory (after the weights) that a checkpoint's KV caches take on
# the CPU, split evenly over the ranks on the host; the rest stays free for activations, the
# engine, the front end and the OS. vLLM's CPU backend leaves a comparable margin.
CPU_KV_MEMORY_FRACTION = 0.5
MEMINFO_PATH = "/proc/meminfo"


def profile_lengths(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the dummy requests: max_num_batched_tokens in all, none past the model."""
    num_full, rest = divmod(max_num_batched_tokens, max_model_len)
    return [max_model_len] * num_full + ([rest] if rest else [])


def profile_step_output(
    model_info: ModelInfo, max_num_batched_tokens: int
) -> tuple[SchedulerOutput, int]:
    """One step that prefills every dummy request whole, and the num_blocks its cache needs.

    Each request gets block ids of its own (1, 2, ...), so every group's table stays in range.
    """
    lengths = profile_lengths(max_num_batched_tokens, model_info.max_model_len)
    block_size = min(group.spec.block_size for group in model_info.kv_cache_groups)
    params = SamplingParams(max_tokens=1)
    requests, next_block_id = [], 1
    for handle, length in enumerate(lengths, start=1):
        block_ids = tuple(
            list(range(next_block_id, next_block_id + cdiv(length, group.spec.block_size)))
            for group in model_info.kv_cache_groups
        )
        next_block_id += cdiv(length, block_size)
        prompt = pack_int32([PROFILE_TOKEN_ID] * length)
        encoder = _profile_encoder_token_ids(model_info, length)
        requests.append(NewRequestData(handle, prompt, params, block_ids, 0, encoder))
    step = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=requests,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=pack_int32(lengths),
        total_num_scheduled_tokens=sum(lengths),
        finished_handles=[],
        preempted_handles=[],
    )
    return step, next_block_id


def _profile_encoder_token_ids(model_info: ModelInfo, length: int) -> bytes | None:
    """An encoder-decoder model's dummy encoder input: as long as its limit allows, within the
    `length` tokens the request's cross-attention blocks hold; None for a decoder-only model."""
    limits = [
        group.spec.max_num_encoder_tokens
        for group in model_info.kv_cache_groups
        if isinstance(group.spec, CrossAttentionSpec)
    ]
    if not limits:
        return None
    return pack_int32([PROFILE_TOKEN_ID] * min(length, *limits))


def run_profile_step(
    model: Model,
    model_info: ModelInfo,
    rank: int,
    tp_size: int,
    device: torch.device,
    max_num_batched_tokens: int,
    step_limits: StepLimits | None = None,  # the runner's, when it prepares into step buffers
) -> int:
    """Run the step on a throwaway runner; the bytes of its KV cache (freed on return)."""
    step, num_blocks = profile_step_output(model_info, max_num_batched_tokens)
    kv_cache_config = KVCacheConfig(num_blocks, model_info.kv_cache_groups)
    kv_caches = allocate_kv_caches(kv_cache_config, tp_size, device)
    if step_limits is not None:  # the dummy requests may outnumber the engine's max_num_seqs
        num_reqs = max(step_limits.max_num_reqs, len(step.scheduled_new_reqs))
        step_limits = StepLimits(step_limits.max_num_tokens, num_reqs)
    runner = ModelRunner(
        model,
        kv_cache_config,
        kv_caches,
        rank,
        model_info.max_model_len,
        device,
        step_limits=step_limits,
    )
    runner.execute_model(step)
    return num_blocks * bytes_per_block(model_info.kv_cache_groups, tp_size)


def capture_graph_bytes(
    model: Model,
    model_info: ModelInfo,
    config: WorkerConfig,
    device: torch.device,
    memory: DeviceMemory,
) -> int:
    """Capture the decode graphs on a throwaway runner over a cache of MIN_NUM_BLOCKS blocks,
    which their dummy steps never touch; the device bytes the graphs held (freed on return)."""
    kv_cache_config = KVCacheConfig(MIN_NUM_BLOCKS, model_info.kv_cache_groups)
    kv_caches = allocate_kv_caches(kv_cache_config, config.tp_size, device)
    limits = StepLimits(config.max_num_batched_tokens, config.max_num_seqs)
    runner = ModelRunner(
        model,
        kv_cache_config,
        kv_caches,
        config.rank,
        model_info.max_model_len,
        device,
        step_limits=limits,
    )
    free_bytes, _ = memory.mem_get_info()
    runner.enable_decode_graphs(decode_buckets(limits.max_decode_batch))
    free_after_bytes, _ = memory.mem_get_info()
    return max(0, free_bytes - free_after_bytes)


def measure_num_blocks(
    config: WorkerConfig,
    model_info: ModelInfo,
    device: torch.device,
    start: MemoryAtStart | None,
    model: Model,
    group: TPGroup,
) -> int:
    """Blocks this rank can hold: kv_cache_memory_bytes when given, else this rank's share of
    the CUDA device less the peak of one profiling step and what others held at start."""
    groups = model_info.kv_cache_groups
    if config.kv_cache_memory_bytes is not None:
        return num_blocks_in_budget(groups, config.tp_size, config.kv_cache_memory_bytes)
    if device.type == "cpu" and isinstance(model, HFDecoder):
        budget_bytes = cpu_kv_budget_bytes(model, group.num_ranks_on_device)
        num_blocks = num_blocks_in_budget(groups, config.tp_size, budget_bytes)
        max_model_len = min(
            config.max_model_len or model_info.max_model_len, model_info.max_model_len
        )
        usable = max_usable_blocks(groups, config.max_num_seqs, max_model_len)
        if usable < num_blocks:
            logger.info(
                "KV pool capped at %d blocks of the %d the budget holds: %d sequences of %d "
                "tokens use no more",
                usable,
                num_blocks,
                config.max_num_seqs,
                max_model_len,
            )
        return min(num_blocks, usable)
    if start is None:
        raise ValueError(
            f"kv_cache_memory_bytes is required on device {device} for model {config.model}, "
            "got None"
        )
    # ranks that share a device share its utilization too
    utilization = config.gpu_memory_utilization / group.num_ranks_on_device
    memory = CudaMemory(device)
    limits = StepLimits(config.max_num_batched_tokens, config.max_num_seqs)
    has_graphs = graph_refusal(config, device, group) is None
    split = profile_capacity(
        memory,
        start,
        lambda: run_profile_step(
            model,
            model_info,
            config.rank,
            config.tp_size,
            device,
            config.max_num_batched_tokens,
            limits if uses_step_buffers(config, device) else None,
        ),
        utilization,
        (lambda: capture_graph_bytes(model, model_info, config, device, memory))
        if has_graphs
        else None,
    )
    logger.info(
        "memory of %s for %d ranks on it, profiled at %d tokens: %s",
        device,
        group.num_ranks_on_device,
        config.max_num_batched_tokens,
        split.describe(),
    )
    return num_blocks_in_budget(groups, config.tp_size, split.kv_budget_bytes)


def max_usable_blocks(
    kv_cache_groups: list[KVCacheGroupSpec], max_num_seqs: int, max_model_len: int
) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens hold in every group at once,
    plus the null block: a larger pool could never be in use.

    Zeroing the pages of a larger one costs start-up time and host memory (a tiny checkpoint's
    half of RAM is millions of blocks), and its only use would be a deeper prefix cache.
    """
    per_seq = sum(cdiv(max_model_len, group.spec.block_size) for group in kv_cache_groups)
    return max_num_seqs * per_seq + 1


def available_memory_bytes() -> int:
    """The host's MemAvailable (free plus reclaimable page cache), else its free pages."""
    try:
        with open(MEMINFO_PATH) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in KiB
    except OSError:
        pass  # not Linux: fall back to sysconf
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_budget_bytes(model: HFDecoder, num_ranks_on_host: int) -> int:
    """CPU_KV_MEMORY_FRACTION of the memory available now (this rank's weights are loaded),
    divided by the ranks on this host; the split is logged."""
    available = available_memory_bytes()
    kv_bytes = int(available * CPU_KV_MEMORY_FRACTION) // num_ranks_on_host
    weights_bytes = model.weights_bytes()
    logger.info(
        "CPU memory of this rank (%d ranks on the host): weights %.3f GiB, KV cache %.3f GiB "
        "(%.0f%% of %.3f GiB available, shared by the ranks), left free %.3f GiB",
        num_ranks_on_host,
        weights_bytes / GIB,
        kv_bytes / GIB,
        CPU_KV_MEMORY_FRACTION * 100,
        available / GIB,
        (available - kv_bytes * num_ranks_on_host) / GIB,
    )
    return kv_bytes
