"""KV-cache specs and the plan that turns every rank's free memory into one KVCacheConfig.

The spec Structs live in protocol/ (the worker allocates from them); this module re-exports them
and owns the capacity arithmetic. It never touches a tensor.
"""

import logging

from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    bytes_per_block,
    cdiv,
)

__all__ = [
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "bytes_per_block",
    "cdiv",
    "describe_capacity",
    "num_blocks_per_request",
    "plan_kv_cache",
]

logger = logging.getLogger(__name__)

NUM_NULL_BLOCKS = 1  # block 0 is the placeholder for skipped positions and holds no tokens


def num_blocks_per_request(kv_cache_groups: list[KVCacheGroupSpec], max_model_len: int) -> int:
    """Blocks one request of `max_model_len` tokens takes from the shared pool at its peak.

    Every group holds its own block for each position. A sliding-window group frees out-of-window
    blocks only after they are computed, so a prompt scheduled in one step needs them all at once.
    """
    return sum(cdiv(max_model_len, group.spec.block_size) for group in kv_cache_groups)


def plan_kv_cache(
    kv_cache_groups: list[KVCacheGroupSpec],
    num_blocks_per_rank: list[int],
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """One KVCacheConfig for every rank: the fewest blocks any rank holds, or the override.

    Args:
        num_blocks_per_rank: the blocks each rank's KV-cache memory holds, indexed by rank (each
            rank measures its own memory in blocks of the agreed layout).
    """
    if not kv_cache_groups:
        raise ValueError("kv_cache_groups is empty: expected at least one group of layers")
    block_sizes = sorted({group.spec.block_size for group in kv_cache_groups})
    if len(block_sizes) != 1:
        raise ValueError(f"kv_cache_groups use block sizes {block_sizes}: expected one block_size")
    if not num_blocks_per_rank or min(num_blocks_per_rank) < 0:
        raise ValueError(
            f"num_blocks_per_rank={num_blocks_per_rank}: expected a count per rank, none negative"
        )
    num_blocks = min(num_blocks_per_rank)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override > num_blocks:
            logger.warning(
                "num_gpu_blocks_override=%d exceeds the %d blocks the smallest rank can hold",
                num_gpu_blocks_override,
                num_blocks,
            )
        num_blocks = num_gpu_blocks_override
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=list(kv_cache_groups))


def describe_capacity(kv_cache_config: KVCacheConfig, max_model_len: int) -> str:
    """ "KV cache holds N tokens; max concurrency X at max_model_len L" """
    groups = kv_cache_config.kv_cache_groups
    num_usable_blocks = kv_cache_config.num_blocks - NUM_NULL_BLOCKS
    num_tokens = num_usable_blocks * groups[0].spec.block_size // len(groups)
    max_concurrency = num_usable_blocks / num_blocks_per_request(groups, max_model_len)
    return (
        f"KV cache holds {num_tokens} tokens; "
        f"max concurrency {max_concurrency:.2f} at max_model_len {max_model_len}"
    )
