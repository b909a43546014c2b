"""Chunked local attention and R-SWA managers: hit scans as tables of cached blocks, skipping
earlier chunks and the R-SWA gap with exact block ids, prompt-only caching, capacity, factory."""

from types import SimpleNamespace

import pytest
from cached_blocks import block_hashes, pool_with_cached
from kv_specs import BLOCK_SIZE, chunked_local_spec, rswa_spec

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import get_kv_cache_coordinator
from engine_core.kv_cache.local_attention_managers import ChunkedLocalAttentionManager, RSWAManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    num_chunk_blocks,
    num_group_blocks_per_request,
)
from engine_core.kv_cache.spec_managers import make_single_type_manager


def _free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


# Token max_length reads only its own chunk: blocks before that chunk are null (0) unlooked-up.
@pytest.mark.parametrize(
    ("attention_chunk_size", "pattern", "max_length", "hit_ids"),
    [
        (4, "1111", 8, [0, 0, 0, 0]),  # token 8 starts a new chunk: nothing need be cached
        (4, "0000", 8, [0, 0, 0, 0]),
        (4, "0010", 7, [0, 0, 3]),  # chunk 1 starts at block 2, which is cached
        (4, "0000", 7, [0, 0]),  # chunk 1's first block misses: only chunk 0 counts
        (4, "1101", 7, [0, 0]),
        (4, "1101", 3, [1]),  # within chunk 0 it is a full-attention scan from block 0
        (4, "0111", 3, []),
    ],
)
def test_chunked_local_hit_is_null_before_the_chunk_then_the_cached_run(
    attention_chunk_size: int, pattern: str, max_length: int, hit_ids: list[int]
) -> None:
    pool, hashes = pool_with_cached(pattern, BLOCK_SIZE)
    (hits,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        hashes, max_length, [0], pool, chunked_local_spec(attention_chunk_size)
    )
    assert [block.block_id for block in hits] == hit_ids
    assert all(block is pool.null_block for block in hits if block.block_id == 0)


@pytest.mark.parametrize(
    ("pattern", "max_length", "num_hit_blocks"),
    [("1111", 8, 4), ("1101", 8, 2), ("0111", 8, 0), ("1111", 7, 3)],
)
def test_rswa_hit_is_the_cached_run_from_block_zero(
    pattern: str, max_length: int, num_hit_blocks: int
) -> None:
    pool, hashes = pool_with_cached(pattern, BLOCK_SIZE)
    (hits,) = RSWAManager.find_longest_cache_hit(hashes, max_length, [0], pool, rswa_spec(2))
    assert [block.block_id for block in hits] == list(range(1, num_hit_blocks + 1))


def test_chunked_local_frees_blocks_of_earlier_chunks_tail_first() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(chunked_local_spec(4), pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 7)
    assert manager.get_skipped_blocks("r", 3) == []
    manager.remove_skipped_blocks("r", 4)  # token 4 opens chunk 1: blocks 1 and 2 are dead
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [0, 0, 3, 4]
    assert _free_ids(pool) == [2, 1, 5, 6, 7]  # the request's later block goes first
    manager.remove_skipped_blocks("r", 7)  # still chunk 1: nothing more
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [0, 0, 3, 4]
    manager.check_invariants()
    manager.free("r")
    assert _free_ids(pool) == [4, 3, 2, 1, 5, 6, 7]
    pool.check_invariants()


def test_rswa_frees_the_gap_between_prompt_and_window_tail_first() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(rswa_spec(2), pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 10)  # blocks 1-5; the prompt is tokens 0-2
    manager.remove_skipped_blocks("r", 7, num_prompt_tokens=3)
    # window starts at max(3, 7 - 2) = 5: block 2 (tokens 4-5) is still read
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [1, 2, 3, 4, 5]
    manager.remove_skipped_blocks("r", 9)  # the prompt length recorded before serves
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [1, 2, 0, 4, 5]
    assert _free_ids(pool) == [3, 6, 7]
    manager.remove_skipped_blocks("r", 10)  # window starts at 8: block 4 (tokens 6-7) is dead
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [1, 2, 0, 0, 5]
    assert _free_ids(pool) == [4, 3, 6, 7]
    manager.check_invariants()
    manager.free("r")
    assert _free_ids(pool) == [5, 2, 1, 4, 3, 6, 7]


def test_rswa_without_a_prompt_length_keeps_every_block_and_caches_nothing() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(rswa_spec(2), pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 10)
    manager.remove_skipped_blocks("r", 10)
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [1, 2, 3, 4, 5]
    manager.cache_blocks(SimpleNamespace(req_id="r", block_hashes=block_hashes(5)), 10)
    assert all(block.block_hash is None for block in pool.blocks)


def test_rswa_caches_only_blocks_wholly_in_the_prompt() -> None:
    """A generated token's K/V depends on where its prompt ended: it must never be a hit."""
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(rswa_spec(2), pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.remove_skipped_blocks("r", 0, num_prompt_tokens=5)  # not held yet: not recorded
    manager.allocate_new_blocks("r", 8)
    manager.remove_skipped_blocks("r", 0, num_prompt_tokens=5)
    manager.cache_blocks(SimpleNamespace(req_id="r", block_hashes=block_hashes(4)), 8)
    assert [block.block_hash is not None for block in manager.req_to_blocks["r"]] == [
        True,
        True,
        False,
        False,
    ]
    assert manager.num_cached_block["r"] == 2
    manager.check_invariants()
    with pytest.raises(ValueError, match="prompt of 6 tokens, expected the 5 recorded before"):
        manager.remove_skipped_blocks("r", 8, num_prompt_tokens=6)


def test_managers_refuse_a_spec_of_another_kind() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True)
    with pytest.raises(TypeError, match="needs an RSWASpec"):
        RSWAManager(chunked_local_spec(4), pool, 0)
    with pytest.raises(TypeError, match="needs a ChunkedLocalAttentionSpec"):
        ChunkedLocalAttentionManager(rswa_spec(2), pool, 0)


def test_chunked_local_refuses_a_chunk_that_starts_mid_block() -> None:
    """A chunk of 5 over blocks of 2 starts inside block 2: a hit of 2 null blocks would leave
    token 4 to be computed with its own chunk (tokens 0-4) already in the null block."""
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True)
    with pytest.raises(ValueError, match="attention_chunk_size=5 is not a multiple of"):
        make_single_type_manager(chunked_local_spec(5), pool, 0)


def test_hybrid_coordinator_agrees_with_full_attention_on_a_chunked_hit() -> None:
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")
    groups = [
        KVCacheGroupSpec(layer_names=["full"], spec=full),
        KVCacheGroupSpec(layer_names=["local"], spec=chunked_local_spec(4)),
    ]
    coordinator = get_kv_cache_coordinator(
        KVCacheConfig(num_blocks=12, kv_cache_groups=groups), True
    )
    assert isinstance(coordinator.single_type_managers[1], ChunkedLocalAttentionManager)
    assert coordinator.can_skip_blocks
    hashes = block_hashes(3)
    stand_in = SimpleNamespace(req_id="setup", block_hashes=hashes)
    coordinator.save_new_computed_blocks("setup", ((), ()))
    coordinator.allocate_new_blocks("setup", 6)  # full: 1-3, local: 4-6
    coordinator.cache_blocks(stand_in, 6)
    coordinator.free("setup")
    hits, num_hit_tokens = coordinator.find_longest_cache_hit(hashes, 6)
    assert num_hit_tokens == 6
    assert [[block.block_id for block in group] for group in hits] == [[1, 2, 3], [0, 0, 6]]
    coordinator.check_invariants()


def test_capacity_counts_one_chunk_for_chunked_local_and_the_sequence_for_rswa() -> None:
    assert num_chunk_blocks(chunked_local_spec(4), 3) == 3  # cdiv(3 + 3, 2)
    assert num_chunk_blocks(chunked_local_spec(4), 4) == 4  # cdiv(3 + 4, 2)
    assert num_group_blocks_per_request(chunked_local_spec(4), 32, 3) == 3
    assert num_group_blocks_per_request(chunked_local_spec(4), 32, None) == 16
    assert num_group_blocks_per_request(chunked_local_spec(64), 32, 3) == 16
    assert num_group_blocks_per_request(rswa_spec(2), 32, 3) == 16
