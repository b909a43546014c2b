"""Prefix-cache retention: which full blocks of a sliding-window group enter the prefix cache.

A window hit at token L reads only the `cdiv(sliding_window - 1, block_size)` blocks before L, so
a window group serves hits at chosen boundaries while indexing only the blocks that end at them.
It decides and caches; it never allocates, frees or looks a hit up.
"""

import math
from collections.abc import Sequence

from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.kv_cache.spec import KVCacheConfig, SlidingWindowSpec, cdiv

SPARSE_RETENTION_SPECS = (SlidingWindowSpec,)  # the kinds whose caching the interval thins out

# What vLLM 0.33.0 does (kv_cache_coordinator.py, SlidingWindowManager.reachable_block_mask), and
# where kvserve differs on purpose:
# - None indexes every full block (both). A positive interval, a multiple of the block size,
#   indexes in each interval-long segment only the blocks a hit at its end reads, plus those a
#   hit at the replay boundary (`num_prompt_tokens - 1`, rounded down to a block) reads (both).
#   Full-attention, chunked-local and R-SWA groups always index densely (both).
# - Both also keep the blocks ending at a request's shared-prefix junction: where the group
#   searched first (full attention) hit on its own at admission, when a window group stopped
#   the agreed hit short of it, so the next sibling leaving that prefix there hits all of it.
#   vLLM's scheduler keeps the junction on the request; kvserve's KVCacheManager keeps it.
# - vLLM's engine flag defaults to 0 (replay boundaries and junctions only) and accepts 0;
#   kvserve defaults to None (what it always did) and takes, as the reference documents say,
#   only a positive multiple of the block size.
# - vLLM also thins Mamba groups; the interval does not apply to kvserve's Mamba groups.


def scheduler_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The granularity every group's blocks end on: the lcm of the groups' block sizes."""
    return math.lcm(*(group.spec.block_size for group in kv_cache_config.kv_cache_groups))


def validate_retention_interval(
    retention_interval: int | None, kv_cache_config: KVCacheConfig
) -> None:
    """Refuse an interval that is not a positive multiple of the block size, or that no group
    would act on (the reference's `_validate_prefix_cache_retention_interval`)."""
    if retention_interval is None:
        return
    if not any(
        isinstance(group.spec, SPARSE_RETENTION_SPECS) for group in kv_cache_config.kv_cache_groups
    ):
        raise ValueError(
            f"prefix_cache_retention_interval={retention_interval} is set but no KV-cache group "
            f"is a sliding window, so it would change nothing: expected it unset"
        )
    block_size = scheduler_block_size(kv_cache_config)
    if retention_interval < 1 or retention_interval % block_size:
        raise ValueError(
            f"prefix_cache_retention_interval={retention_interval}: expected a positive multiple "
            f"of the block size {block_size}"
        )


def window_group_ids(kv_cache_config: KVCacheConfig) -> frozenset[int]:
    """The groups a retention interval or a coarser hit alignment thins out."""
    groups = kv_cache_config.kv_cache_groups
    return frozenset(
        group_id
        for group_id, group in enumerate(groups)
        if isinstance(group.spec, SPARSE_RETENTION_SPECS)
    )


def sparse_retention_group_ids(
    retention_interval: int | None, kv_cache_config: KVCacheConfig
) -> frozenset[int]:
    """The groups whose caching `retention_interval` thins out (none when it is None)."""
    validate_retention_interval(retention_interval, kv_cache_config)
    if retention_interval is None:
        return frozenset()
    return window_group_ids(kv_cache_config)


def cache_retained_blocks(
    manager: SingleTypeKVCacheManager,
    request: KVCacheRequest,
    num_tokens: int,
    retention_interval: int | None,
    shared_prefix_boundary: int = 0,
    alignment_tokens: int | None = None,
) -> None:
    """A window group's `cache_blocks` when not every block can serve a hit (a retention
    interval, or hits that end on `alignment_tokens`, a multiple of its block size): every
    block that fills up counts as cached, but only those `window_block_mask` keeps enter the
    index."""
    req_id, block_size = request.req_id, manager.block_size
    num_cached = manager.num_cached_block[req_id]
    num_full = num_tokens // block_size
    if num_full <= num_cached:
        return
    spec = manager.kv_cache_spec
    assert isinstance(spec, SlidingWindowSpec), f"retention on group of {spec}"
    boundaries = [request.num_prompt_tokens - 1]
    if shared_prefix_boundary:
        boundaries.append(shared_prefix_boundary)
    block_mask = window_block_mask(
        spec, num_cached, num_full, retention_interval, boundaries, alignment_tokens or block_size
    )
    manager.block_pool.cache_full_blocks(
        request,
        manager.req_to_blocks[req_id],
        num_cached,
        num_full,
        block_size,
        manager.kv_cache_group_id,
        block_mask,
    )
    manager.num_cached_block[req_id] = num_full


def window_block_mask(
    spec: SlidingWindowSpec,
    start_idx: int,
    end_idx: int,
    retention_interval: int | None,
    boundaries: Sequence[int],
    alignment_tokens: int | None = None,
) -> list[bool] | None:
    """Which of blocks `[start_idx, end_idx)` a window group caches, or None for all of them.

    Hits end on multiples of `alignment_tokens` (the lcm of the groups' block sizes; this
    group's block size by default). It keeps the blocks a hit reads at each boundary worth a
    hit: the end of every segment (`retention_interval` tokens, or `alignment_tokens` without
    one), and, with an interval, each of `boundaries` rounded down to the alignment: the replay
    boundary `num_prompt_tokens - 1` (where a resend of the same prompt stops its hit) and a
    shared-prefix junction. None when a segment holds no more blocks than one hit reads.

    ```
    interval 8, block 2, window 3 (a hit reads 1 block), prompt of 21 tokens:
    block:  0 1 2 3 | 4 5 6 7 | 8 9 10 11
    kept:         x |       x |   x    x   (9 ends the replay boundary, token 20)
    ```
    """
    block_size = spec.block_size
    alignment = alignment_tokens or block_size
    if alignment % block_size:
        return None  # a block-granular mask cannot follow a finer alignment: keep them all
    num_read = cdiv(spec.sliding_window - 1, block_size)  # blocks one hit reads
    num_per_segment = (retention_interval or alignment) // block_size
    if num_read >= num_per_segment:
        return None
    first_kept = num_per_segment - num_read  # offset in a segment of its first kept block
    mask = [idx % num_per_segment >= first_kept for idx in range(start_idx, end_idx)]
    for boundary in boundaries if retention_interval is not None else ():
        boundary_idx = boundary // alignment * alignment // block_size
        for idx in range(max(start_idx, boundary_idx - num_read), min(end_idx, boundary_idx)):
            mask[idx - start_idx] = True
    return mask
