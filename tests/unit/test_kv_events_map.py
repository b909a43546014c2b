"""A subscriber that applies the block pool's KV events holds exactly the pool's prefix-cache map:
a hash is announced with its first cached copy and removed with its last, and a run of new blocks
with a gap before it names the right parent. Pools are tiny: 8 blocks of 4 tokens.
"""

from kv_specs import full_spec, window_spec

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec
from engine_core.sched.request import Request
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    block_removed,
    block_stored,
)
from protocol.sampling import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 8
HASHER = BlockHasher(BLOCK_SIZE)


def make_request(req_id: str, token_ids: list[int]) -> Request:
    return Request(req_id, token_ids, SamplingParams(), block_hasher=HASHER)


def apply(events: list[KVCacheEvent], keys: set[bytes]) -> None:
    """What a router does with the stream: keys as `block_hash_with_group_id`."""
    for event in events:
        match event:
            case BlockStored():
                keys.update(
                    make_block_hash_with_group_id(h, event.group_idx) for h in event.block_hashes
                )
            case BlockRemoved():
                for block_hash in event.block_hashes:
                    keys.remove(make_block_hash_with_group_id(block_hash, event.group_idx))
            case AllBlocksCleared():
                keys.clear()


def pool_keys(pool: BlockPool) -> set[bytes]:
    pool.check_invariants()
    return {bytes.fromhex(key) for key in pool.cached_block_counts()}


def test_two_copies_are_announced_once_and_removed_with_the_last() -> None:
    """Guards against a BlockRemoved for one copy of a hash still cached in another block, which
    left routers believing a cached prefix was gone (and a second BlockStored for the copy)."""
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
    first, second = make_request("a", list(range(8))), make_request("b", list(range(8)))
    blocks_a, blocks_b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_blocks(first, blocks_a, 0, 2, BLOCK_SIZE, 0)
    pool.cache_full_blocks(second, blocks_b, 0, 2, BLOCK_SIZE, 0)
    assert pool.take_events() == [block_stored(first.block_hashes, None, list(range(8)), 4, 0)]
    assert pool.cached_block_counts() == {
        make_block_hash_with_group_id(h, 0).hex(): 2 for h in first.block_hashes
    }
    pool.evict_blocks([blocks_a[1].block_id])
    assert pool.take_events() == []
    pool.evict_blocks([blocks_b[1].block_id])
    assert pool.take_events() == [block_removed([first.block_hashes[1]], 0)]


def test_a_run_after_a_cached_copy_names_its_parent() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
    first, second = make_request("a", list(range(12))), make_request("b", list(range(12)))
    pool.cache_full_blocks(first, pool.get_new_blocks(3), 0, 3, BLOCK_SIZE, 0)
    blocks = pool.get_new_blocks(3)
    pool.evict_blocks([1, 3])  # first's blocks 0 and 2 leave; block 1's hash stays cached
    pool.take_events()
    pool.cache_full_blocks(second, blocks, 0, 3, BLOCK_SIZE, 0)
    hashes = second.block_hashes
    assert pool.take_events() == [
        block_stored([hashes[0]], None, [0, 1, 2, 3], BLOCK_SIZE, 0),
        block_stored([hashes[2]], hashes[1], [8, 9, 10, 11], BLOCK_SIZE, 0),
    ]


def test_applying_the_stream_rebuilds_the_map_through_eviction_and_reset() -> None:
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
    keys: set[bytes] = set()
    for round_idx in range(6):  # prompts overlap by prefix and outgrow the 7 usable blocks
        request = make_request(str(round_idx), [round_idx % 3] * 4 + list(range(4 * round_idx)))
        num_blocks = min(len(request.block_hashes), pool.get_num_free_blocks())
        blocks = pool.get_new_blocks(num_blocks)
        pool.cache_full_blocks(request, blocks, 0, num_blocks, BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        apply(pool.take_events(), keys)
        assert keys == pool_keys(pool)
    assert pool.reset_prefix_cache()
    apply(pool.take_events(), keys)
    assert keys == pool_keys(pool) == set()


def test_a_hybrid_models_stream_rebuilds_every_groups_map() -> None:
    """Two groups (full attention and a sliding window) share the pool: each group's hashes are
    announced and removed under its own group_idx, through hits, eviction, window skips and a
    reset, so the subscriber's keys equal the pool's after every step."""
    groups = [
        KVCacheGroupSpec(layer_names=["full"], spec=full_spec(BLOCK_SIZE)),
        KVCacheGroupSpec(layer_names=["window"], spec=window_spec(2 * BLOCK_SIZE, BLOCK_SIZE)),
    ]
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=24, kv_cache_groups=groups),
        max_model_len=64,
        enable_kv_cache_events=True,
    )
    keys: set[bytes] = set()
    num_hit_tokens_seen = 0
    for round_idx in range(10):  # shared prefixes, then fresh prompts that force eviction
        prefix = [round_idx % 3] * 8 if round_idx < 6 else [50 + round_idx] * 8
        request = make_request(str(round_idx), prefix + list(range(round_idx, round_idx + 10)))
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        num_hit_tokens_seen += num_hit_tokens
        assert manager.allocate_slots(
            request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
        )
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        apply(manager.take_events(), keys)
        assert keys == pool_keys(manager.block_pool), f"round {round_idx}"
    assert num_hit_tokens_seen > 0, "shared prefixes should hit"
    assert {key[-4:] for key in keys} == {bytes(4), (1).to_bytes(4, "big")}, "both groups cached"
    assert manager.reset_prefix_cache()
    apply(manager.take_events(), keys)
    assert keys == pool_keys(manager.block_pool) == set()
