"""SchedulerLimits: the per-step and per-sequence bounds the scheduler works within.

Derived once from the configs, the model and the pool; a combination that could never make
progress (a prompt that fits no step, a sequence that fits no pool) is refused here.
"""

import logging
from dataclasses import dataclass

from engine_core.kv_cache.spec import (
    NUM_NULL_BLOCKS,
    num_blocks_per_request,
    resolve_hash_block_size,
)
from protocol.config import CacheConfig, SchedulerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import ModelInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_model_len: int  # tokens per sequence, prompt and output; never above the model's
    # Tokens per hashed block (the KV cache's hash_block_size): the gcd of the groups' block
    # sizes, so every group's block is a whole number of them; the cache config's block_size.
    block_size: int
    prefill_cap: int  # most tokens one prefill gets per step; 0 means no cap
    num_blocks_per_request: int  # the most blocks one request holds at once, over every group


def resolve_limits(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    kv_cache_config: KVCacheConfig,
    model_info: ModelInfo,
) -> SchedulerLimits:
    """The limits, or `ValueError` naming the settings that cannot work together."""
    max_model_len = _max_model_len(scheduler_config, model_info)
    block_size = _block_size(cache_config, kv_cache_config)
    if not scheduler_config.enable_chunked_prefill and (
        scheduler_config.max_num_batched_tokens < max_model_len
    ):
        raise ValueError(
            f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} is below "
            f"max_model_len={max_model_len}: without chunked prefill a prompt must fit in one step"
        )
    threshold = scheduler_config.long_prefill_token_threshold
    prefill_cap = threshold if threshold and scheduler_config.enable_chunked_prefill else 0
    num_blocks_needed = num_blocks_per_request(
        kv_cache_config.kv_cache_groups,
        max_model_len,
        _max_num_scheduled_tokens(scheduler_config, prefill_cap),
    )
    num_usable_blocks = kv_cache_config.num_blocks - NUM_NULL_BLOCKS
    if num_blocks_needed > num_usable_blocks:
        # Such a request would preempt itself forever once it grew long enough.
        raise ValueError(
            f"one request of max_model_len={max_model_len} tokens needs {num_blocks_needed} "
            f"blocks, but num_blocks={kv_cache_config.num_blocks} leaves {num_usable_blocks} "
            "usable: expected more KV-cache memory, a smaller max_model_len or a larger "
            "num_gpu_blocks_override"
        )
    return SchedulerLimits(max_model_len, block_size, prefill_cap, num_blocks_needed)


def _max_num_scheduled_tokens(scheduler_config: SchedulerConfig, prefill_cap: int) -> int | None:
    """The most tokens one request gets slots for in one step, or None when admission reserves
    the whole prompt (then a sliding-window group holds every block of it at once)."""
    if scheduler_config.reserve_full_prompt:
        return None
    return prefill_cap or scheduler_config.max_num_batched_tokens


def _max_model_len(scheduler_config: SchedulerConfig, model_info: ModelInfo) -> int:
    configured = scheduler_config.max_model_len
    if configured is None:
        return model_info.max_model_len
    if configured > model_info.max_model_len:
        logger.warning(
            "max_model_len=%d exceeds the model's %d; using the model's",
            configured,
            model_info.max_model_len,
        )
        return model_info.max_model_len
    return configured


def _block_size(cache_config: CacheConfig, kv_cache_config: KVCacheConfig) -> int:
    """The block size requests hash at, which must be the one the engine was configured with.

    Groups may use larger blocks (a multiple of it, as a model's window layers may); the cache
    config names the gcd, so a mistyped --block-size is still refused by name.
    """
    groups = kv_cache_config.kv_cache_groups
    hash_block_size = resolve_hash_block_size(groups)
    if hash_block_size != cache_config.block_size:
        block_sizes = sorted({group.spec.block_size for group in groups})
        raise ValueError(
            f"kv-cache groups use block sizes {block_sizes}, so requests hash at "
            f"block_size={hash_block_size}: expected the cache config's {cache_config.block_size}"
        )
    return hash_block_size
