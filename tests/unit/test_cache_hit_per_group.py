"""find_longest_cache_hit_per_group: each group's own longest hit, against a brute-force search."""

from cached_blocks import block_hashes, cache_then_free
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_specs import (
    BLOCK_SIZE,
    chunked_local_spec,
    full_spec,
    kv_cache_config,
    rswa_spec,
    window_spec,
)

from engine_core.kv_cache.coordinator import get_kv_cache_coordinator
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
    cdiv,
)

NUM_HASHES = 12
CHUNKED = chunked_local_spec(4)
RSWA = rswa_spec(2)
LAYOUTS = [
    (full_spec(),),
    (window_spec(5),),
    (full_spec(), window_spec(5)),
    (full_spec(), window_spec(3), window_spec(3)),
    (full_spec(), CHUNKED),
    (full_spec(), RSWA),
    (full_spec(), window_spec(7), CHUNKED, RSWA),
]


def _config(specs: tuple[KVCacheSpec, ...]) -> KVCacheConfig:
    return kv_cache_config(len(specs) * NUM_HASHES + 1, *specs)


def _brute_force_hit_blocks(spec: KVCacheSpec, cached: list[bool], max_length: int) -> int:
    """The most blocks n (n * block_size <= max_length) whose tokens a hit of n blocks may skip.

    Straight from each attention kind's definition: which earlier blocks the next token reads.
    """
    max_blocks = min(max_length // BLOCK_SIZE, len(cached))
    for num_blocks in range(max_blocks, -1, -1):
        match spec:
            case SlidingWindowSpec():
                first_read = max(0, num_blocks - cdiv(spec.sliding_window - 1, BLOCK_SIZE))
            case ChunkedLocalAttentionSpec():
                chunk_start = max_length // spec.attention_chunk_size * spec.attention_chunk_size
                first_read = chunk_start // BLOCK_SIZE
                if num_blocks < first_read:
                    continue
            case FullAttentionSpec() | RSWASpec():
                first_read = 0
        if all(cached[first_read:num_blocks]):
            return num_blocks
    raise AssertionError("0 blocks is always a hit")


@settings(max_examples=150, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    data=st.data(),
    max_length=st.integers(0, NUM_HASHES * BLOCK_SIZE + 3),
)
def test_each_group_hits_as_far_as_its_own_cached_blocks_allow(
    layout: tuple[KVCacheSpec, ...], data: st.DataObject, max_length: int
) -> None:
    coordinator = get_kv_cache_coordinator(_config(layout), enable_caching=True)
    pool = coordinator.block_pool
    hashes = block_hashes(NUM_HASHES)
    patterns = [
        data.draw(st.lists(st.booleans(), min_size=NUM_HASHES, max_size=NUM_HASHES)) for _ in layout
    ]
    for group_id, pattern in enumerate(patterns):
        cache_then_free(pool, hashes, pattern, BLOCK_SIZE, group_id)

    hits, hit_lengths = coordinator.find_longest_cache_hit_per_group(hashes, max_length)

    assert len(hits) == len(hit_lengths) == len(layout)
    for group_id, spec in enumerate(layout):
        # Groups of one spec search together, so a block hits only where all of them cached it.
        same_spec = [patterns[other] for other, s in enumerate(layout) if s == spec]
        cached = [all(column) for column in zip(*same_spec, strict=True)]
        num_blocks = _brute_force_hit_blocks(spec, cached, max_length)
        assert hit_lengths[group_id] == num_blocks * BLOCK_SIZE, (group_id, spec)
        assert len(hits[group_id]) == num_blocks
        for idx, block in enumerate(hits[group_id]):
            if not block.is_null:
                assert block.block_hash == hashes[idx] + group_id.to_bytes(4, "big")
    # The agreed hit never goes past any group's own.
    _, hit_length = coordinator.find_longest_cache_hit(hashes, max_length)
    assert hit_length <= min(hit_lengths)
    pool.check_invariants()


def test_per_group_hit_shows_a_window_group_that_outlives_full_attention() -> None:
    """Full attention lost its tail; the window group still holds it, and the per-group answer
    says so while the agreed hit stops where full attention does."""
    coordinator = get_kv_cache_coordinator(_config((full_spec(), window_spec(3))), True)
    hashes = block_hashes(6)
    pool = coordinator.block_pool
    cache_then_free(pool, hashes, [True, True, False, False, False, False], BLOCK_SIZE, 0)
    cache_then_free(pool, hashes, [True] * 6, BLOCK_SIZE, 1)
    _, hit_lengths = coordinator.find_longest_cache_hit_per_group(hashes, 11)
    assert hit_lengths == (4, 10)
    assert coordinator.find_longest_cache_hit(hashes, 11)[1] == 4


def test_no_prefix_cache_coordinator_reports_no_hit_in_any_group() -> None:
    coordinator = get_kv_cache_coordinator(_config((full_spec(), window_spec(3))), False)
    hits, hit_lengths = coordinator.find_longest_cache_hit_per_group([BlockHash(b"x" * 8)], 8)
    assert hit_lengths == (0, 0) and all(len(group_hits) == 0 for group_hits in hits)
