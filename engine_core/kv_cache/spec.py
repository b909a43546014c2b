"""KV-cache specs and the plan that turns every rank's free memory into one KVCacheConfig.

The spec Structs live in protocol/ (the worker allocates from them); this module re-exports them
and owns the planning arithmetic. It never touches a tensor.
"""

import logging
from dataclasses import dataclass

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
    "KVCachePlan",
    "KVCacheSpec",
    "SlidingWindowSpec",
    "bytes_per_block",
    "cdiv",
    "num_blocks_per_request",
    "plan_kv_cache",
]

logger = logging.getLogger(__name__)

NUM_NULL_BLOCKS = 1  # block 0 is the placeholder for skipped positions and holds no tokens


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """The agreed layout, each rank's own block count, and a one-line explanation of both."""

    config: KVCacheConfig
    num_blocks_per_rank: list[int]  # blocks each rank's memory can hold, before taking the minimum
    summary: str  # "KV cache holds N tokens; max concurrency X at max_model_len L"


def num_blocks_per_request(kv_cache_groups: list[KVCacheGroupSpec], max_model_len: int) -> int:
    """Blocks one request of `max_model_len` tokens takes from the shared pool at its peak.

    Every group holds its own block for each position. A sliding-window group frees out-of-window
    blocks only after they are computed, so a prompt scheduled in one step needs them all at once.
    """
    return sum(cdiv(max_model_len, group.spec.block_size) for group in kv_cache_groups)


def plan_kv_cache(
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory_bytes: list[int],
    tp_size: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
) -> KVCachePlan:
    """One KVCacheConfig for every rank: the fewest blocks any rank holds, or the override.

    Args:
        available_memory_bytes: the KV-cache memory each rank reported, indexed by rank.
    """
    _check_plan_inputs(kv_cache_groups, available_memory_bytes, tp_size, max_model_len)
    block_bytes = bytes_per_block(kv_cache_groups, tp_size)
    num_blocks_per_rank = [memory_bytes // block_bytes for memory_bytes in available_memory_bytes]
    num_blocks = min(num_blocks_per_rank)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override > num_blocks:
            logger.warning(
                "num_gpu_blocks_override=%d exceeds the %d blocks the smallest rank can hold",
                num_gpu_blocks_override,
                num_blocks,
            )
        num_blocks = num_gpu_blocks_override
    num_usable_blocks = num_blocks - NUM_NULL_BLOCKS
    blocks_per_request = num_blocks_per_request(kv_cache_groups, max_model_len)
    if num_usable_blocks < blocks_per_request:
        raise ValueError(
            f"one request of max_model_len={max_model_len} needs {blocks_per_request} blocks, "
            f"but num_blocks={num_blocks} leaves {num_usable_blocks} usable "
            f"({block_bytes} bytes per block on each rank, ranks hold {num_blocks_per_rank}): "
            "expected more KV-cache memory or a smaller max_model_len"
        )
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=list(kv_cache_groups))
    block_size = kv_cache_groups[0].spec.block_size
    num_tokens = num_usable_blocks * block_size // len(kv_cache_groups)
    max_concurrency = num_usable_blocks / blocks_per_request
    summary = (
        f"KV cache holds {num_tokens} tokens; "
        f"max concurrency {max_concurrency:.2f} at max_model_len {max_model_len}"
    )
    return KVCachePlan(config=config, num_blocks_per_rank=num_blocks_per_rank, summary=summary)


def _check_plan_inputs(
    kv_cache_groups: list[KVCacheGroupSpec],
    available_memory_bytes: list[int],
    tp_size: int,
    max_model_len: int,
) -> None:
    if not kv_cache_groups:
        raise ValueError("kv_cache_groups is empty: expected at least one group of layers")
    block_sizes = sorted({group.spec.block_size for group in kv_cache_groups})
    if len(block_sizes) != 1:
        raise ValueError(f"kv_cache_groups use block sizes {block_sizes}: expected one block_size")
    if len(available_memory_bytes) != tp_size:
        raise ValueError(
            f"got available memory for {len(available_memory_bytes)} ranks: "
            f"expected one per rank of tp_size={tp_size}"
        )
    if min(available_memory_bytes) < 0:
        raise ValueError(f"available_memory_bytes={available_memory_bytes}: expected no negative")
    if max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len}: expected at least 1")
