"""KVCacheManager scenarios: each test tells one story with exact block ids and free-queue order."""

import pytest

from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from engine_core.sched.request import Request
from protocol.kv_events import AllBlocksCleared, BlockStored
from protocol.sampling import SamplingParams
from protocol.stats import PrefixCacheStats


def _config(block_size: int, num_blocks: int, sliding_window: int | None = None) -> KVCacheConfig:
    if sliding_window is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=4, dtype="float32")
    else:
        spec = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_dim=4,
            dtype="float32",
            sliding_window=sliding_window,
        )
    group = KVCacheGroupSpec(layer_names=["layers.0"], spec=spec)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[group])


def _manager(block_size: int = 16, num_blocks: int = 10, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(_config(block_size, num_blocks), max_model_len=1024, **kwargs)


def _request(req_id: str, token_ids: list[int], block_size: int = 16) -> Request:
    return Request(req_id, token_ids, SamplingParams(), block_hasher=BlockHasher(block_size))


def _admit(manager: KVCacheManager, request: Request) -> KVCacheBlocks | None:
    """What the scheduler does for a waiting request: look up, then allocate the whole prompt."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def _ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def _hashed_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.blocks if b.block_hash is not None]


def test_prompt_of_55_tokens_gets_four_blocks_and_hashes_the_three_full_ones() -> None:
    manager = _manager()
    request = _request("a", list(range(55)))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert (hits.get_block_ids(), num_hit_tokens) == (([],), 0)
    new_blocks = manager.allocate_slots(request, 55)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2, 3, 4],)
    assert _hashed_ids(manager) == [1, 2, 3]
    assert manager.get_block_ids("a") == ([1, 2, 3, 4],)
    manager.check_invariants()


def test_prompt_sharing_48_tokens_hits_three_blocks_and_gets_one_new() -> None:
    manager = _manager()
    first = _request("a", list(range(55)))
    _admit(manager, first)
    second = _request("b", [*range(48), *range(100, 107)])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2, 3],), 48)
    assert _ref_cnts(manager)[1:5] == [1, 1, 1, 1]  # the lookup touched nothing
    new_blocks = manager.allocate_slots(second, 55 - 48, 48, hits)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)
    assert manager.get_block_ids("b") == ([1, 2, 3, 5],)
    assert _ref_cnts(manager)[1:6] == [2, 2, 2, 1, 1]
    manager.check_invariants()


def test_decode_fills_the_partial_block_before_taking_a_new_one() -> None:
    manager = _manager()
    request = _request("a", list(range(55)))
    _admit(manager, request)
    for token_id in range(1000, 1009):  # tokens 56..64: the last one fills block 4
        request.append_output_token_ids(token_id)
        new_blocks = manager.allocate_slots(request, 1)
        assert new_blocks is not None and new_blocks.get_block_ids() == ([],)
        request.num_computed_tokens += 1
        assert (4 in _hashed_ids(manager)) == (request.num_tokens == 64)
    assert request.num_tokens == 64 and _hashed_ids(manager) == [1, 2, 3, 4]
    request.append_output_token_ids(2000)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)
    assert _hashed_ids(manager) == [1, 2, 3, 4]
    manager.check_invariants()


def test_failed_allocation_after_a_hit_changes_no_ref_cnt() -> None:
    manager = _manager(num_blocks=7)  # 6 usable blocks
    _admit(manager, _request("a", list(range(55))))  # blocks 1-4
    second = _request("b", [*range(48), *range(100, 150)])  # 98 tokens: 7 blocks, 3 of them hits
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == ([1, 2, 3],)
    ref_cnts, free_ids = _ref_cnts(manager), _free_ids(manager)
    assert manager.allocate_slots(second, 98 - num_hit_tokens, num_hit_tokens, hits) is None
    assert _ref_cnts(manager) == ref_cnts
    assert _free_ids(manager) == free_ids
    assert manager.get_block_ids("b") == ([],)
    manager.check_invariants()


def test_own_hit_blocks_are_never_evicted_to_make_room_for_the_same_request() -> None:
    manager = _manager(block_size=4, num_blocks=5)  # 4 usable blocks
    first = _request("a", list(range(16)), block_size=4)
    _admit(manager, first)
    manager.free(first)
    assert _free_ids(manager) == [4, 3, 2, 1]  # tail first, all hashed: LRU order
    # 20 tokens need 5 blocks; 3 are evictable hits, so 2 new ones would have to evict them.
    second = _request("b", [*range(12), *range(50, 58)], block_size=4)
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2, 3],), 12)
    assert manager.allocate_slots(second, 8, num_hit_tokens, hits) is None
    assert _free_ids(manager) == [4, 3, 2, 1] and _hashed_ids(manager) == [1, 2, 3, 4]
    # 16 tokens fit: the three hits plus block 4, whose stale hash is evicted.
    third = _request("c", [*range(12), *range(50, 54)], block_size=4)
    hits, num_hit_tokens = manager.get_computed_blocks(third)
    new_blocks = manager.allocate_slots(third, 4, num_hit_tokens, hits)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("c") == ([1, 2, 3, 4],)
    manager.check_invariants()


def test_full_hit_still_leaves_the_last_token_to_compute() -> None:
    manager = _manager(block_size=4)
    _admit(manager, _request("a", list(range(16)), block_size=4))
    same = _request("b", list(range(16)), block_size=4)
    hits, num_hit_tokens = manager.get_computed_blocks(same)
    assert (hits.get_block_ids(), num_hit_tokens) == (([1, 2, 3],), 12)
    new_blocks = manager.allocate_slots(same, 4, num_hit_tokens, hits)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5],)


def test_identical_prompts_allocated_in_one_step_share_their_full_blocks() -> None:
    manager = _manager(block_size=4)
    first = _request("a", list(range(10)), block_size=4)
    second = _request("b", list(range(10)), block_size=4)
    # One scheduling step: neither has computed anything when the other is admitted.
    assert _admit(manager, first) is not None
    new_blocks = _admit(manager, second)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    assert _ref_cnts(manager)[1:5] == [2, 2, 1, 1]
    manager.check_invariants()


def test_with_caching_off_there_is_never_a_hit() -> None:
    manager = _manager(block_size=4, enable_caching=False)
    for req_id in ("a", "b", "c"):
        request = _request(req_id, list(range(10)), block_size=4)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert (hits.get_block_ids(), num_hit_tokens) == (([],), 0)
        assert manager.allocate_slots(request, 10) is not None
    assert manager.get_block_ids("c") == ([7, 8, 9],)
    assert _hashed_ids(manager) == []
    manager.check_invariants()


def test_sliding_window_frees_out_of_window_blocks_tail_first_after_11_tokens() -> None:
    manager = KVCacheManager(_config(2, 10, sliding_window=4), max_model_len=64)
    request = _request("a", list(range(11)), block_size=2)
    assert manager.allocate_slots(request, 11).get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    request.num_computed_tokens = 11
    assert _free_ids(manager) == [7, 8, 9]
    request.append_output_token_ids(99)
    # Token 11 reads tokens 8..11, so blocks 1-4 (tokens 0..7) are dead.
    assert manager.allocate_slots(request, 1).get_block_ids() == ([],)
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 5, 6],)
    # Hashed blocks go to the LRU tail in the order freed: 4 first, so a prefix's tail goes first.
    assert _free_ids(manager) == [7, 8, 9, 4, 3, 2, 1]
    manager.check_invariants()
    manager.free(request)
    assert _free_ids(manager) == [7, 8, 9, 4, 3, 2, 1, 6, 5]
    manager.check_invariants()


def test_sliding_window_without_caching_reuses_freed_blocks_first() -> None:
    manager = KVCacheManager(
        _config(2, 10, sliding_window=4), max_model_len=64, enable_caching=False
    )
    request = _request("a", list(range(11)), block_size=2)
    manager.allocate_slots(request, 11)
    request.num_computed_tokens = 11
    request.append_output_token_ids(99)
    manager.allocate_slots(request, 1)
    assert _free_ids(manager) == [4, 3, 2, 1, 7, 8, 9]


def test_sliding_window_blocks_freed_by_skipping_make_room_for_the_same_call() -> None:
    manager = KVCacheManager(_config(2, 7, sliding_window=4), max_model_len=64)  # 6 usable
    request = _request("a", list(range(12)), block_size=2)
    assert manager.allocate_slots(request, 12).get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    request.num_computed_tokens = 12
    request.append_output_token_ids(99)
    new_blocks = manager.allocate_slots(request, 1)  # no free block, but blocks 1-4 are dead
    # They were freed 4, 3, 2, 1 to the LRU tail, so block 4 is reused and loses its hash.
    assert new_blocks is not None and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 5, 6, 4],)
    assert _free_ids(manager) == [3, 2, 1] and _hashed_ids(manager) == [1, 2, 3, 5, 6]
    manager.check_invariants()


def test_sliding_window_allocation_that_does_not_fit_keeps_its_skipped_blocks() -> None:
    manager = KVCacheManager(_config(2, 8, sliding_window=4), max_model_len=64)  # 7 usable
    request = _request("a", list(range(12)), block_size=2)
    manager.allocate_slots(request, 12)  # blocks 1-6
    manager.allocate_slots(_request("b", [5, 6], block_size=2), 2)  # block 7: none left free
    request.num_computed_tokens = 12
    ref_cnts = _ref_cnts(manager)
    # 9 more tokens need 5 more blocks; skipping would free only 4 (tokens 0..7).
    assert manager.allocate_slots(request, 9) is None
    assert manager.get_block_ids("a") == ([1, 2, 3, 4, 5, 6],)
    assert _ref_cnts(manager) == ref_cnts and _free_ids(manager) == []
    manager.check_invariants()


def test_lookahead_slots_are_allocated_but_never_hashed() -> None:
    manager = _manager(block_size=4)
    request = _request("a", list(range(6)), block_size=4)
    new_blocks = manager.allocate_slots(request, 6, num_lookahead_tokens=4)
    assert new_blocks.get_block_ids() == ([1, 2, 3],)
    assert _hashed_ids(manager) == [1]


def test_slots_are_capped_at_max_model_len() -> None:
    manager = KVCacheManager(_config(4, 10), max_model_len=8)
    request = _request("a", list(range(8)), block_size=4)
    assert manager.allocate_slots(request, 8, num_lookahead_tokens=8).get_block_ids() == ([1, 2],)


def test_allocate_slots_rejects_zero_new_tokens() -> None:
    manager = _manager()
    with pytest.raises(ValueError, match="num_new_tokens=0 for a"):
        manager.allocate_slots(_request("a", [1, 2, 3]), 0)


def test_prefix_cache_stats_count_preempted_readmissions_apart() -> None:
    manager = _manager(block_size=4)
    _admit(manager, _request("a", list(range(10)), block_size=4))
    _admit(manager, _request("b", list(range(10)), block_size=4))
    preempted = _request("c", list(range(9)), block_size=4)
    preempted.num_preemptions = 1
    _admit(manager, preempted)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert stats.resets == 0
    stats.queries = 0  # a copy: the reader cannot change the manager's totals
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(2, 20, 8, 1, 9, 8, 0)


def test_prefix_cache_stats_count_a_request_once_at_admission() -> None:
    manager = _manager(block_size=4, num_blocks=4)  # 3 usable blocks
    big = _request("a", list(range(20)), block_size=4)
    for _ in range(3):  # a waiting request looked up on every step it does not fit
        assert _admit(manager, big) is None
    decode = _request("b", list(range(5)), block_size=4)
    _admit(manager, decode)
    decode.append_output_token_ids(9)
    manager.allocate_slots(decode, 1)  # a running request: not an admission
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 5, 0)


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks() -> None:
    manager = _manager(block_size=4, enable_kv_cache_events=True)
    request = _request("a", list(range(10)), block_size=4)
    _admit(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.usage == 0.0
    assert manager.reset_prefix_cache()
    assert _hashed_ids(manager) == [] and manager.make_prefix_cache_stats().resets == 1
    events = manager.take_events()
    assert isinstance(events[0], BlockStored) and events[0].block_hashes == request.block_hashes
    assert isinstance(events[-1], AllBlocksCleared)
    assert manager.take_events() == []


def test_usage_counts_held_blocks_and_free_releases_them() -> None:
    manager = _manager(block_size=4, num_blocks=5)
    request = _request("a", list(range(6)), block_size=4)
    _admit(manager, request)
    assert manager.usage == 0.5
    manager.free(request)
    assert manager.usage == 0.0 and manager.get_block_ids("a") == ([],)
    manager.check_invariants()


def test_kv_cache_blocks_concatenate_per_group() -> None:
    manager = _manager(block_size=4)
    request = _request("a", list(range(8)), block_size=4)
    first = manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    second = manager.allocate_slots(request, 4)
    assert (first + second).get_block_ids() == ([1, 2],)
    assert (manager.empty_kv_cache_blocks + first).get_block_ids() == ([1],)


def test_hash_block_size_must_equal_the_block_size() -> None:
    with pytest.raises(ValueError, match="hash_block_size=8 differs"):
        KVCacheManager(_config(4, 10), max_model_len=64, hash_block_size=8)
