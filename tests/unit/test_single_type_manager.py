"""Per-group managers: hit scans as tables of cached blocks, capacity, skipping, tail-first free."""

import functools

import pytest
from cached_blocks import pool_with_cached
from kv_specs import BLOCK_SIZE, full_spec, window_spec

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SlidingWindowManager,
)
from engine_core.kv_cache.spec_managers import make_single_type_manager

FULL = full_spec(BLOCK_SIZE)
_window = functools.partial(window_spec, block_size=BLOCK_SIZE)


@pytest.mark.parametrize(
    ("pattern", "max_length", "num_hit_blocks"),
    [
        ("1111", 8, 4),
        ("1101", 8, 2),  # stops at the first miss
        ("0111", 8, 0),
        ("1111", 7, 3),  # a partial last block is never a hit
        ("", 8, 0),
    ],
)
def test_full_attention_hit_is_the_cached_run_from_block_zero(
    pattern: str, max_length: int, num_hit_blocks: int
) -> None:
    pool, hashes = pool_with_cached(pattern, BLOCK_SIZE)
    (hits,) = FullAttentionManager.find_longest_cache_hit(hashes, max_length, [0], pool, FULL)
    assert [block.block_id for block in hits] == list(range(1, num_hit_blocks + 1))


# cdiv(sliding_window - 1, 2) contiguous cached blocks make a hit; earlier blocks are null (0).
@pytest.mark.parametrize(
    ("sliding_window", "pattern", "max_length", "hit_ids"),
    [
        (4, "1111", 8, [0, 0, 3, 4]),  # needs 2 blocks: the last two
        (4, "0011", 8, [0, 0, 3, 4]),  # the blocks outside the window need not be cached
        (4, "1101", 8, [1, 2]),  # the run at the end is too short; blocks 0-1 qualify
        (4, "0101", 8, []),  # no run long enough, and block 0 misses
        (4, "1000", 8, [1]),  # a short run from block 0 is still a hit
        (4, "1111", 5, [1, 2]),  # only two whole blocks fit under max_length
        (3, "0001", 8, [0, 0, 0, 4]),  # needs 1 block
        (7, "0111", 8, [0, 2, 3, 4]),  # needs 3 blocks
        (7, "1011", 8, [1]),  # the run 2-3 is one block short
        (7, "1101", 6, [1, 2]),
    ],
)
def test_sliding_window_hit_needs_a_run_covering_the_window(
    sliding_window: int, pattern: str, max_length: int, hit_ids: list[int]
) -> None:
    pool, hashes = pool_with_cached(pattern, BLOCK_SIZE)
    (hits,) = SlidingWindowManager.find_longest_cache_hit(
        hashes, max_length, [0], pool, _window(sliding_window)
    )
    assert [block.block_id for block in hits] == hit_ids
    assert all(block is pool.null_block for block in hits if block.block_id == 0)


def test_capacity_counts_evictable_hit_blocks_as_consumed() -> None:
    pool, hashes = pool_with_cached("111", BLOCK_SIZE)  # blocks 1-3 cached and free
    manager = FullAttentionManager(FULL, pool, 0)
    (hits,) = FullAttentionManager.find_longest_cache_hit(hashes, 6, [0], pool, FULL)
    # 10 tokens need 5 blocks: 3 hits (each still in the free queue) + 2 new.
    assert manager.get_num_blocks_to_allocate("r", 10, hits) == 5
    pool.touch(hits[:1])  # held by someone else: no longer takes a free block
    assert manager.get_num_blocks_to_allocate("r", 10, hits) == 4
    assert manager.get_num_blocks_to_allocate("r", 4, []) == 2
    assert manager.req_to_blocks == {}  # a query records nothing


def test_free_releases_blocks_tail_first() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(FULL, pool, 0)
    manager.save_new_computed_blocks("r", [])
    assert [b.block_id for b in manager.allocate_new_blocks("r", 5)] == [1, 2, 3]
    manager.free("r")
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [3, 2, 1, 4, 5, 6, 7]  # unhashed: the request's last block is reused first
    assert manager.req_to_blocks == {} and manager.num_cached_block == {}
    pool.check_invariants()


def test_running_request_cannot_take_new_computed_blocks() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(FULL, pool, 0)
    manager.save_new_computed_blocks("r", [])
    with pytest.raises(ValueError, match="request r already holds blocks in group 0"):
        manager.save_new_computed_blocks("r", [pool.blocks[3]])


def test_remove_skipped_blocks_replaces_them_with_null_and_stops_at_the_first_null() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True)
    manager = make_single_type_manager(_window(4), pool, 0)
    assert isinstance(manager, SlidingWindowManager)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 12)  # blocks 1-6
    manager.remove_skipped_blocks("r", 7)  # token 7 reads 4..7: blocks 1-2 are dead
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [0, 0, 3, 4, 5, 6]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()][:2] == [2, 1]
    assert manager.get_skipped_blocks("r", 9) == [pool.blocks[3]]
    manager.remove_skipped_blocks("r", 9)
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [0, 0, 0, 4, 5, 6]
    manager.check_invariants()
    pool.check_invariants()


def test_full_attention_never_skips_blocks() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True)
    manager = make_single_type_manager(FULL, pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 12)
    manager.remove_skipped_blocks("r", 12)
    assert [b.block_id for b in manager.req_to_blocks["r"]] == [1, 2, 3, 4, 5, 6]


def test_invariants_catch_a_block_listed_twice() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    manager = make_single_type_manager(FULL, pool, 0)
    manager.save_new_computed_blocks("r", [])
    manager.allocate_new_blocks("r", 4)
    manager.req_to_blocks["r"].append(manager.req_to_blocks["r"][0])
    with pytest.raises(AssertionError, match="lists a block twice"):
        manager.check_invariants()
