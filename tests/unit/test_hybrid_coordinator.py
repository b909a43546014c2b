"""Hybrid models: a full-attention group and sliding-window groups sharing one BlockPool."""

import functools
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_specs import BLOCK_SIZE, full_spec, hashed_request, kv_cache_config, window_spec

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from engine_core.kv_cache.hashing import BlockHash, get_block_hash, get_group_id
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from engine_core.sched.request import Request

FULL = full_spec(BLOCK_SIZE)
_window = functools.partial(window_spec, block_size=BLOCK_SIZE)


def _admit(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    request.num_computed_tokens = request.num_tokens


def _cache(pool: BlockPool, hashes: list[BlockHash], group_id: int, cached_idxs: set[int]) -> None:
    """Put fresh blocks in the cache under `hashes[i]` for group `group_id`, i in cached_idxs."""
    blocks = pool.get_new_blocks(len(hashes))
    stand_in = SimpleNamespace(req_id="setup", block_hashes=hashes)
    for idx in sorted(cached_idxs):
        pool.cache_full_blocks(stand_in, blocks, idx, idx + 1, BLOCK_SIZE, group_id)
    pool.free_blocks(blocks[::-1])


def test_factory_picks_the_coordinator_by_caching_and_group_count() -> None:
    one, two = kv_cache_config(8, FULL), kv_cache_config(8, FULL, _window(4))
    assert type(get_kv_cache_coordinator(one, True)) is UnitaryKVCacheCoordinator
    assert type(get_kv_cache_coordinator(two, True)) is HybridKVCacheCoordinator
    assert type(get_kv_cache_coordinator(two, False)) is KVCacheCoordinatorNoPrefixCache
    other = FullAttentionSpec(block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
    mixed = get_kv_cache_coordinator(kv_cache_config(8, FULL, other), True)
    assert isinstance(mixed, HybridKVCacheCoordinator)  # groups may differ in block size
    assert (mixed.hash_block_size, mixed.alignment_tokens) == (2, 4)


def test_same_tokens_give_different_keys_per_group() -> None:
    manager = KVCacheManager(kv_cache_config(20, FULL, _window(4)), max_model_len=64)
    request = hashed_request("a", list(range(9)))
    _admit(manager, request)
    full_ids, window_ids = manager.get_block_ids("a")
    assert (full_ids, window_ids) == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    blocks = manager.block_pool.blocks
    for full_id, window_id in zip(full_ids[:4], window_ids[:4], strict=True):
        full_key, window_key = blocks[full_id].block_hash, blocks[window_id].block_hash
        assert full_key != window_key
        assert get_block_hash(full_key) == get_block_hash(window_key)
        assert (get_group_id(full_key), get_group_id(window_key)) == (0, 1)
    manager.check_invariants()


def test_evicting_window_blocks_keeps_the_hit_but_evicting_the_first_full_block_drops_it() -> None:
    manager = KVCacheManager(kv_cache_config(20, FULL, _window(4)), max_model_len=64)
    first = hashed_request("a", list(range(9)))
    _admit(manager, first)
    manager.free(first)
    again = hashed_request("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8
    assert hits.get_block_ids() == ([1, 2, 3, 4], [0, 0, 8, 9])
    manager.block_pool.evict_blocks([6, 7])  # window blocks of tokens 0-3: outside the window
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert (num_hit_tokens, hits.get_block_ids()) == (8, ([1, 2, 3, 4], [0, 0, 8, 9]))
    manager.block_pool.evict_blocks([1])
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert (num_hit_tokens, hits.get_block_ids()) == (0, ([], []))
    manager.check_invariants()


def test_inconsistent_hits_converge_to_the_longest_length_every_group_agrees_on() -> None:
    # Group 0 full attention, group 1 needs 1 cached block at the end, group 2 needs 2.
    coordinator = get_kv_cache_coordinator(kv_cache_config(40, FULL, _window(3), _window(4)), True)
    pool, hashes = coordinator.block_pool, [BlockHash(bytes([i]) * 8) for i in range(5)]
    _cache(pool, hashes, 0, {0, 1, 2, 3, 4})
    _cache(pool, hashes, 1, {0, 1, 2, 4})
    _cache(pool, hashes, 2, {0, 1, 2, 3})
    # Length 5 blocks fails group 2, 4 fails group 1 (block 3 missing), 3 suits all three.
    hits, hit_length = coordinator.find_longest_cache_hit(hashes, 10)
    assert hit_length == 6
    full_hits, window3_hits, window4_hits = hits
    assert [b.block_id for b in full_hits] == [1, 2, 3]
    assert [b.block_id for b in window3_hits] == [0, 0, 8]
    # Group 2's blocks are 9 (the unhashed one group 1 freed to the head), then 11, 12, 13, 14.
    assert [b.block_id for b in window4_hits] == [0, 11, 12]


def test_window_miss_truncates_the_full_attention_hit() -> None:
    coordinator = get_kv_cache_coordinator(kv_cache_config(40, FULL, _window(4)), True)
    pool, hashes = coordinator.block_pool, [BlockHash(bytes([i]) * 8) for i in range(4)]
    _cache(pool, hashes, 0, {0, 1, 2, 3})
    _cache(pool, hashes, 1, {0, 1, 3})
    hits, hit_length = coordinator.find_longest_cache_hit(hashes, 8)
    assert hit_length == 4
    assert [[b.block_id for b in group] for group in hits] == [[1, 2], [5, 6]]


def test_every_groups_hits_are_touched_before_any_new_block_is_allocated() -> None:
    manager = KVCacheManager(kv_cache_config(9, FULL, _window(4)), max_model_len=64)  # 8 usable
    first = hashed_request("a", list(range(8)))
    _admit(manager, first)
    manager.free(first)
    free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_ids == [4, 3, 2, 1, 8, 7, 6, 5]
    second = hashed_request("b", [*range(8), 50, 51])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert (num_hit_tokens, hits.get_block_ids()) == (8, ([1, 2, 3, 4], [0, 0, 7, 8]))
    # Allocating group 0's block before touching group 1's hits would pop block 8.
    new_blocks = manager.allocate_slots(second, 2, num_hit_tokens, hits)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([6], [5])
    assert manager.get_block_ids("b") == ([1, 2, 3, 4, 6], [0, 0, 7, 8, 5])
    manager.check_invariants()


def test_hybrid_allocation_that_does_not_fit_changes_nothing() -> None:
    manager = KVCacheManager(kv_cache_config(9, FULL, _window(4)), max_model_len=64)
    first = hashed_request("a", list(range(8)))
    _admit(manager, first)
    manager.free(first)
    second = hashed_request("b", [*range(8), *range(50, 56)])  # 7 blocks per group: 14 > 8
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    ref_cnts = [b.ref_cnt for b in manager.block_pool.blocks]
    assert manager.allocate_slots(second, 6, num_hit_tokens, hits) is None
    assert [b.ref_cnt for b in manager.block_pool.blocks] == ref_cnts
    assert manager.get_block_ids("b") == ([], [])
    manager.check_invariants()


def test_hybrid_decode_frees_only_the_window_groups_old_blocks() -> None:
    manager = KVCacheManager(kv_cache_config(30, FULL, _window(4)), max_model_len=64)
    request = hashed_request("a", list(range(10)))
    _admit(manager, request)
    request.append_output_token_ids(77)
    assert manager.allocate_slots(request, 1).get_block_ids() == ([11], [12])
    # Token 10 reads tokens 7..10: the window group drops the blocks of tokens 0..5 only.
    assert manager.get_block_ids("a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    manager.check_invariants()
    manager.free(request)
    assert manager.usage == 0.0
    manager.check_invariants()


def _agrees(cached: list[bool], spec: KVCacheSpec, num_blocks: int) -> bool:
    """Whether one group can serve a hit of `num_blocks` blocks, from its cached pattern alone."""
    if isinstance(spec, SlidingWindowSpec):
        num_needed = cdiv(spec.sliding_window - 1, BLOCK_SIZE)
        return all(cached[max(0, num_blocks - num_needed) : num_blocks])
    return all(cached[:num_blocks])


@settings(max_examples=150)
@given(
    windows=st.lists(st.sampled_from([None, 2, 3, 4, 5, 7]), min_size=1, max_size=3),
    patterns=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=3, max_size=3),
    max_length=st.integers(0, 13),
)
def test_hit_length_is_the_longest_every_group_can_serve(
    windows: list[int | None], patterns: list[list[bool]], max_length: int
) -> None:
    """Guards against a fixed point that stops short of, or overshoots, the best common length."""
    specs = [FULL if window is None else _window(window) for window in windows]
    coordinator = get_kv_cache_coordinator(kv_cache_config(1 + 6 * len(specs), *specs), True)
    hashes = [BlockHash(bytes([i]) * 8) for i in range(6)]
    for group_id, cached in enumerate(patterns[: len(specs)]):
        _cache(coordinator.block_pool, hashes, group_id, {i for i, c in enumerate(cached) if c})
    hits, hit_length = coordinator.find_longest_cache_hit(hashes, max_length)
    expected = max(
        num_blocks
        for num_blocks in range(max_length // BLOCK_SIZE + 1)
        if num_blocks <= 6
        and all(_agrees(c, s, num_blocks) for c, s in zip(patterns, specs, strict=False))
    )
    assert hit_length == expected * BLOCK_SIZE
    for group_id, blocks in enumerate(hits):
        assert len(blocks) == expected
        for idx, block in enumerate(blocks):
            assert block.is_null or block.block_hash[:-4] == hashes[idx]
            assert not block.is_null or isinstance(specs[group_id], SlidingWindowSpec)
