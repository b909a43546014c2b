"""EnginePlan: everything the engine decides once at startup from its config and the ranks' hellos
(the KV-cache layout and num_blocks, the scheduler's limits, a one-line capacity summary). Every
startup check lives here, once; no sockets.
"""

import logging
from dataclasses import dataclass

from engine_core.kv_cache.spec import describe_capacity, plan_kv_cache
from engine_core.sched.limits import SchedulerLimits, resolve_limits
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import ModelInfo

logger = logging.getLogger(__name__)

# Host memory of the pool's bookkeeping per block (KVCacheBlock, its free-queue links, its slot
# in the block list), measured: a BlockPool of 1,000,000 blocks took 120.4 bytes per block, both
# in tracemalloc's count and in the process's resident memory (CPython 3.11).
POOL_HOST_BYTES_PER_BLOCK = 120


@dataclass(frozen=True, slots=True)
class EnginePlan:
    kv_cache_config: KVCacheConfig  # sent to every rank, and the pool's size
    limits: SchedulerLimits
    num_blocks_per_rank: list[int]  # what each rank's memory holds, before taking the minimum
    summary: str  # "KV cache holds N tokens; max concurrency X at max_model_len L"


def plan_engine(
    config: EngineConfig, model_info: ModelInfo, num_blocks_per_rank: list[int]
) -> EnginePlan:
    """The plan, or ValueError naming the settings that cannot work together."""
    if len(num_blocks_per_rank) != config.tp_size:
        raise ValueError(
            f"got capacities of {len(num_blocks_per_rank)} ranks: "
            f"expected one per rank of tp_size={config.tp_size}"
        )
    kv_cache_config = plan_kv_cache(
        model_info.kv_cache_groups, num_blocks_per_rank, config.cache.num_gpu_blocks_override
    )
    kv_cache_config = KVCacheConfig(
        kv_cache_config.num_blocks,
        kv_cache_config.kv_cache_groups,
        check_invariants=config.check_invariants,  # the ranks walk theirs when the engine does
    )
    check_pool_host_memory(kv_cache_config.num_blocks, config.max_pool_host_memory_bytes)
    limits = resolve_limits(config.scheduler, config.cache, kv_cache_config, model_info)
    summary = describe_capacity(
        kv_cache_config, limits.max_model_len, limits.num_blocks_per_request
    )
    return EnginePlan(kv_cache_config, limits, list(num_blocks_per_rank), summary)


def check_pool_host_memory(num_blocks: int, max_pool_host_memory_bytes: int | None) -> None:
    """State the pool's host memory, and refuse a pool past the limit (None: no limit)."""
    pool_bytes = num_blocks * POOL_HOST_BYTES_PER_BLOCK
    logger.info(
        "the block pool of %d blocks takes about %.1f MiB of host memory",
        num_blocks,
        pool_bytes / 2**20,
    )
    if max_pool_host_memory_bytes is not None and pool_bytes > max_pool_host_memory_bytes:
        raise ValueError(
            f"a pool of {num_blocks} blocks needs about {pool_bytes} bytes of host memory "
            f"({POOL_HOST_BYTES_PER_BLOCK} per block), more than max_pool_host_memory_bytes="
            f"{max_pool_host_memory_bytes}: cap the pool with --num-gpu-blocks-override (at most "
            f"{max_pool_host_memory_bytes // POOL_HOST_BYTES_PER_BLOCK} blocks) or raise "
            "--max-pool-host-memory-bytes"
        )
