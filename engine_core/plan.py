"""EnginePlan: everything the engine decides once at startup from its config and the ranks' hellos
(the KV-cache layout and num_blocks, the scheduler's limits, a one-line capacity summary). Every
startup check lives here, once; no sockets.
"""

from dataclasses import dataclass

from engine_core.kv_cache.spec import describe_capacity, plan_kv_cache
from engine_core.sched.limits import SchedulerLimits, resolve_limits
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import ModelInfo


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
    limits = resolve_limits(config.scheduler, config.cache, kv_cache_config, model_info)
    summary = describe_capacity(kv_cache_config, limits.max_model_len)
    return EnginePlan(kv_cache_config, limits, list(num_blocks_per_rank), summary)
