"""BlockPool scenarios, one story each, asserting exact block ids and exact free-queue order.

Pools are tiny (8 blocks of 4 tokens): block 0 is the null block, so ids 1..7 are usable.
"""

import gc

import pytest

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_metrics import BlockMetricsCollector
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.sched.request import Request
from protocol.kv_events import AllBlocksCleared, block_removed, block_stored
from protocol.sampling import SamplingParams
from protocol.stats import BlockResidencyStats

BLOCK_SIZE = 4
NUM_BLOCKS = 8
HASHER = BlockHasher(BLOCK_SIZE)


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, token_ids, SamplingParams(), cache_salt=cache_salt, block_hasher=HASHER)


def make_pool(enable_caching: bool = True, **kwargs: object) -> BlockPool:
    pool = BlockPool(NUM_BLOCKS, enable_caching, **kwargs)
    pool.check_invariants()
    return pool


def ids(blocks: list[KVCacheBlock] | None) -> list[int] | None:
    return None if blocks is None else [block.block_id for block in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    pool.check_invariants()
    return ids(pool.free_block_queue.get_all_free_blocks())


def admit(pool: BlockPool, request: Request, num_blocks: int) -> list[KVCacheBlock]:
    """Allocate `num_blocks` new blocks for a request and cache its full ones."""
    blocks = pool.get_new_blocks(num_blocks)
    num_full = min(request.num_tokens // BLOCK_SIZE, num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_full, BLOCK_SIZE, 0)
    pool.check_invariants()
    return blocks


def lookup(pool: BlockPool, request: Request) -> list[KVCacheBlock]:
    """The longest cached prefix of a request, scanning left to right until the first miss."""
    hits: list[KVCacheBlock] = []
    for block_hash in request.block_hashes:
        cached = pool.get_cached_block(block_hash, [0])
        if cached is None:
            break
        hits.extend(cached)
    return hits


def test_fresh_pool_allocates_ids_from_one_and_reserves_the_null_block() -> None:
    pool = make_pool()
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert free_ids(pool) == [4, 5, 6, 7]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(3 / 7)


def test_request_sharing_a_cached_prefix_hits_those_blocks_and_shares_them() -> None:
    pool = make_pool()
    first = admit(pool, make_request("a", list(range(10))), 3)
    second = make_request("b", [*range(8), 99, 98])
    hits = lookup(pool, second)
    assert ids(hits) == [1, 2]
    pool.touch(hits)
    assert [block.ref_cnt for block in first] == [2, 2, 1]
    assert free_ids(pool) == [4, 5, 6, 7]


def test_touch_takes_free_hit_blocks_out_of_the_queue() -> None:
    pool = make_pool()
    first = admit(pool, make_request("a", list(range(8))), 2)
    pool.free_blocks(reversed(first))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]
    hits = lookup(pool, make_request("b", list(range(8))))
    pool.touch(hits)
    assert ids(hits) == [1, 2] and [block.ref_cnt for block in hits] == [1, 1]
    assert free_ids(pool) == [3, 4, 5, 6, 7]


def test_free_puts_unhashed_blocks_at_the_head_and_hashed_at_the_tail_tail_first() -> None:
    pool = make_pool()
    blocks = admit(pool, make_request("a", list(range(10))), 4)  # 2 full, 1 partial, 1 empty
    assert [block.block_hash is not None for block in blocks] == [True, True, False, False]
    pool.free_blocks(reversed(blocks))
    # Unhashed 4 then 3 go to the head in the order they reached zero; hashed 2 then 1 to the
    # tail, so the prefix's tail block is evicted before its head.
    assert free_ids(pool) == [4, 3, 5, 6, 7, 2, 1]
    assert ids(pool.get_new_blocks(1)) == [4]


def test_reused_cached_block_loses_its_hash_so_the_old_prefix_does_not_hit_it() -> None:
    pool = make_pool(enable_kv_cache_events=True)
    old = make_request("a", list(range(8)))
    pool.free_blocks(reversed(admit(pool, old, 2)))
    pool.take_events()
    reused = pool.get_new_blocks(6)  # 3..7, then block 2: the tail of the old prefix
    assert ids(reused) == [3, 4, 5, 6, 7, 2]
    assert pool.blocks[2].block_hash is None
    assert pool.take_events() == [block_removed([old.block_hashes[1]], 0)]
    assert ids(lookup(pool, make_request("b", list(range(8))))) == [1]
    assert free_ids(pool) == [1]


def test_same_block_listed_twice_in_one_free_is_queued_once() -> None:
    pool = make_pool()
    (block,) = admit(pool, make_request("a", list(range(4))), 1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block, block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 4, 5, 6, 7, 1]


def test_evicting_one_of_two_blocks_with_the_same_hash_keeps_the_other_reachable() -> None:
    pool = make_pool()
    first = admit(pool, make_request("a", list(range(4))), 1)
    second = admit(pool, make_request("b", list(range(4))), 1)  # computed twice: no dedup
    key = first[0].block_hash
    assert key == second[0].block_hash
    assert pool.cached_block_hash_to_block.get_one_block(key) is first[0]  # earliest wins
    pool.evict_blocks([first[0].block_id])
    assert first[0].block_hash is None
    assert ids(lookup(pool, make_request("c", list(range(4))))) == [2]
    assert free_ids(pool) == [3, 4, 5, 6, 7]


def test_reusing_one_duplicate_keeps_the_other_reachable() -> None:
    pool = make_pool()
    first = admit(pool, make_request("a", list(range(4))), 1)
    second = admit(pool, make_request("b", list(range(4))), 1)
    pool.free_blocks(first)
    pool.get_new_blocks(6)  # 3..7 then block 1, whose hash is evicted
    assert ids(lookup(pool, make_request("c", list(range(4))))) == ids(second) == [2]


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    pool = make_pool(enable_kv_cache_events=True)
    blocks = admit(pool, make_request("a", list(range(8))), 2)
    pool.take_events()
    assert pool.reset_refusal_reason() == "2 blocks are still held by requests, expected 0"
    assert pool.reset_prefix_cache() is False
    assert all(block.block_hash is not None for block in blocks)
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))  # the request finishes: now nothing is held
    assert pool.reset_prefix_cache() is True
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]


def test_reset_prefix_cache_clears_every_hash_and_keeps_the_free_order() -> None:
    pool = make_pool(enable_kv_cache_events=True)
    pool.free_blocks(reversed(admit(pool, make_request("a", list(range(8))), 2)))
    order = free_ids(pool)
    pool.take_events()
    assert pool.reset_refusal_reason() is None
    assert pool.reset_prefix_cache() is True
    assert all(block.block_hash is None for block in pool.blocks)
    assert len(pool.cached_block_hash_to_block) == 0
    assert free_ids(pool) == order == [3, 4, 5, 6, 7, 2, 1]
    assert pool.take_events() == [AllBlocksCleared()]
    assert lookup(pool, make_request("b", list(range(8)))) == []


def test_evict_blocks_with_an_out_of_range_id_raises_and_changes_nothing() -> None:
    pool = make_pool()
    blocks = admit(pool, make_request("a", list(range(4))), 1)
    for bad_id in (NUM_BLOCKS, -1):
        with pytest.raises(ValueError, match=rf"cannot evict block {bad_id}: .*\[0, 8\)"):
            pool.evict_blocks([blocks[0].block_id, bad_id])
    assert blocks[0].block_hash is not None
    pool.check_invariants()


def test_evict_blocks_leaves_free_blocks_in_place_and_sends_held_ones_to_the_head() -> None:
    pool = make_pool()
    held = admit(pool, make_request("a", list(range(8))), 2)
    freed = admit(pool, make_request("b", [7] * 8), 2)
    pool.free_blocks(reversed(freed))
    assert free_ids(pool) == [5, 6, 7, 4, 3]
    pool.evict_blocks([0, held[1].block_id, freed[0].block_id])  # id 0 does nothing
    assert free_ids(pool) == [5, 6, 7, 4, 3]
    assert pool.blocks[3].block_hash is None and held[1].block_hash is None
    pool.free_blocks(reversed(held))
    assert free_ids(pool) == [2, 5, 6, 7, 4, 3, 1]


@pytest.mark.parametrize("num_blocks", [8, -1])
def test_get_new_blocks_beyond_free_or_negative_raises_and_changes_nothing(
    num_blocks: int,
) -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match=f"cannot get {num_blocks} new blocks: 7 free"):
        pool.get_new_blocks(num_blocks)
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_new_blocks(0) == []


def test_freeing_more_often_than_referenced_raises_and_restores_every_ref_cnt() -> None:
    pool = make_pool()
    blocks = admit(pool, make_request("a", list(range(8))), 2)
    with pytest.raises(ValueError, match=r"cannot free block 2: .* \(ref_cnt 0\)"):
        pool.free_blocks([blocks[1], blocks[0], blocks[1]])
    assert [block.ref_cnt for block in blocks] == [1, 1]
    assert free_ids(pool) == [3, 4, 5, 6, 7]
    pool.free_blocks(reversed(blocks))
    with pytest.raises(ValueError, match="cannot free block 1"):
        pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 0
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]


def test_null_block_is_ignored_by_touch_free_and_cache() -> None:
    pool = make_pool()
    request = make_request("a", list(range(8)))
    blocks = [pool.null_block, *pool.get_new_blocks(1)]
    pool.cache_full_blocks(request, blocks, 0, 2, BLOCK_SIZE, 0)
    assert pool.null_block.block_hash is None and blocks[1].block_hash is not None
    pool.touch([pool.null_block])
    pool.free_blocks([blocks[1], pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 4, 5, 6, 7, 1]


@pytest.mark.parametrize("events", [False, True])
def test_caching_a_block_that_already_has_a_hash_raises_and_undoes_the_call(events: bool) -> None:
    """What it filed leaves the index, past null and masked blocks; routers hear of none."""
    pool = make_pool(enable_kv_cache_events=events)
    request = make_request("a", list(range(20)))
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(request, blocks, 4, 5, BLOCK_SIZE, 0)  # block 5, at index 4
    assert len(pool.take_events()) == events
    blocks[0] = pool.null_block
    mask = [True, True, False, True, True]
    with pytest.raises(ValueError, match="cannot cache block 5 at index 4"):
        pool.cache_full_blocks(request, blocks, 0, 5, BLOCK_SIZE, 0, mask)
    assert [block.block_hash is None for block in blocks] == [True, True, True, True, False]
    for idx in (1, 3):  # what it filed is gone from the index
        assert pool.get_cached_block(request.block_hashes[idx], [0]) is None
    assert pool.take_events() == []
    pool.check_invariants()


def test_caching_more_blocks_than_the_request_has_hashes_raises() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="cannot cache 2 full blocks of request a"):
        pool.cache_full_blocks(make_request("a", list(range(6))), blocks, 0, 2, BLOCK_SIZE, 0)
    pool.check_invariants()


def test_same_tokens_in_two_groups_are_two_keys() -> None:
    pool = make_pool()
    request = make_request("a", list(range(4)))
    full, window = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(request, full, 0, 1, BLOCK_SIZE, 0)
    assert ids(pool.get_cached_block(request.block_hashes[0], [0, 1])) is None
    pool.cache_full_blocks(request, window, 0, 1, BLOCK_SIZE, 1)
    assert ids(pool.get_cached_block(request.block_hashes[0], [1, 0])) == [2, 1]
    assert window[0].block_hash == make_block_hash_with_group_id(request.block_hashes[0], 1)


def test_cache_salt_separates_identical_prompts() -> None:
    pool = make_pool()
    admit(pool, make_request("a", list(range(8)), cache_salt="tenant-a"), 2)
    assert lookup(pool, make_request("b", list(range(8)), cache_salt="tenant-b")) == []
    assert ids(lookup(pool, make_request("c", list(range(8)), cache_salt="tenant-a"))) == [1, 2]


def test_with_caching_off_nothing_is_hashed_and_nothing_hits() -> None:
    pool = make_pool(enable_caching=False)
    request = make_request("a", list(range(8)))
    blocks = admit(pool, request, 2)
    assert all(block.block_hash is None for block in blocks)
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1, 3, 4, 5, 6, 7]
    assert lookup(pool, make_request("b", list(range(8)))) == []


def test_block_stored_event_carries_the_new_blocks_and_their_parent() -> None:
    pool = make_pool(enable_kv_cache_events=True)
    request = make_request("a", list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 1, BLOCK_SIZE, 0)
    pool.cache_full_blocks(request, blocks, 1, 3, BLOCK_SIZE, 0)
    pool.cache_full_blocks(request, blocks, 3, 3, BLOCK_SIZE, 0)  # nothing new: no event
    hashes = request.block_hashes
    assert pool.take_events() == [
        block_stored([hashes[0]], None, [0, 1, 2, 3], BLOCK_SIZE, 0),
        block_stored(hashes[1:3], hashes[0], list(range(4, 12)), BLOCK_SIZE, 0),
    ]
    assert pool.take_events() == []


def test_block_stored_event_skips_null_blocks() -> None:
    pool = make_pool(enable_kv_cache_events=True)
    request = make_request("a", list(range(12)))
    blocks = [pool.null_block, *pool.get_new_blocks(1), pool.null_block]
    pool.cache_full_blocks(request, blocks, 0, 3, BLOCK_SIZE, 1)
    hashes = request.block_hashes
    assert pool.take_events() == [block_stored([hashes[1]], hashes[0], [4, 5, 6, 7], BLOCK_SIZE, 1)]


def test_no_events_are_recorded_unless_enabled() -> None:
    pool = make_pool()
    pool.free_blocks(admit(pool, make_request("a", list(range(8))), 2))
    pool.get_new_blocks(7)
    assert pool.take_events() == []


def test_metrics_collector_reports_lifetime_idle_time_and_reuse_gap() -> None:
    now = [0.0]
    collector = BlockMetricsCollector(sample_every=1, clock=lambda: now[0])
    pool = make_pool(metrics_collector=collector)
    blocks = admit(pool, make_request("a", list(range(4))), 1)  # allocated at t=0
    pool.free_blocks(blocks)
    now[0] = 2.0
    pool.touch(lookup(pool, make_request("b", list(range(4)))))  # hit at t=2
    pool.free_blocks(blocks)
    now[0] = 5.0
    pool.evict_blocks([1])  # evicted at t=5
    assert collector.take_stats() == BlockResidencyStats([5.0], [3.0], [2.0])
    assert collector.take_stats() == BlockResidencyStats()  # drained
    assert collector.num_tracked_blocks == 0
    collector.check_invariants()


def test_metrics_collector_samples_one_allocation_in_n() -> None:
    collector = BlockMetricsCollector(sample_every=3)
    pool = make_pool(metrics_collector=collector)
    pool.get_new_blocks(7)
    assert collector.num_tracked_blocks == 2
    assert collector.take_stats() == BlockResidencyStats()  # nothing evicted yet


def test_check_invariants_catches_a_hash_missing_from_the_map() -> None:
    pool = make_pool()
    (block,) = admit(pool, make_request("a", list(range(4))), 1)
    pool.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
    with pytest.raises(AssertionError, match=r"block 1 carries .* the map does not hold it"):
        pool.check_invariants()


def test_check_invariants_catches_a_held_block_left_in_the_queue() -> None:
    pool = make_pool()
    pool.blocks[3].ref_cnt = 1
    with pytest.raises(AssertionError, match="block 3 has ref_cnt 1 but is_queued=True"):
        pool.check_invariants()


def test_metrics_collector_drops_a_block_reused_without_ever_being_cached() -> None:
    """Guards against a never-cached block's stale record timing a later, unrelated eviction."""
    now = [0.0]
    collector = BlockMetricsCollector(sample_every=2, clock=lambda: now[0])
    pool = make_pool(metrics_collector=collector)
    (block,) = pool.get_new_blocks(1)  # allocation 1: not sampled
    pool.free_blocks([block])
    (block,) = pool.get_new_blocks(1)  # allocation 2 is sampled: block 1 again, unhashed
    assert block.block_id == 1 and collector.num_tracked_blocks == 1
    pool.free_blocks([block])
    now[0] = 4.0
    (block,) = pool.get_new_blocks(1)  # allocation 3, not sampled: the record is dropped
    assert block.block_id == 1 and collector.num_tracked_blocks == 0
    admit(pool, make_request("a", list(range(4))), 1)  # allocation 4: block 2, sampled at t=4
    now[0] = 9.0
    pool.evict_blocks([2])
    assert collector.take_stats().lifetimes_s == [5.0]
    collector.check_invariants()


def test_construction_leaves_the_garbage_collector_as_it_found_it() -> None:
    """Guards against a pool that pauses the cyclic collector to build its blocks and never
    restarts it (or starts one the application had paused)."""
    assert gc.isenabled()
    assert len(make_pool().blocks) == NUM_BLOCKS and gc.isenabled()
    gc.disable()
    try:
        make_pool()
        assert not gc.isenabled()
    finally:
        gc.enable()
