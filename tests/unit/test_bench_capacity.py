"""bench/capacity.py: the summed-layout baseline and today's plan over the same specs."""

from bench.capacity import shared_layout_tokens, summed_layout_tokens
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

SHAPE = {"block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"}
PAGE_BYTES = 2 * 4 * 2 * 8 * 4  # K and V, 4 tokens, 2 heads of 8, float32


def _groups(window: int | None) -> list[KVCacheGroupSpec]:
    second = (
        FullAttentionSpec(**SHAPE)
        if window is None
        else SlidingWindowSpec(**SHAPE, sliding_window=window)
    )
    return [
        KVCacheGroupSpec(["l0", "l2"], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec(["l1", "l3"], second),
    ]


def test_a_block_id_costs_one_group_s_pages_so_two_groups_hold_twice_the_tokens() -> None:
    """Two groups of two layers: the summed layout paid four pages per block id while each
    group used two; the shared one pays two, so the same budget holds twice the block ids."""
    budget = 101 * 2 * PAGE_BYTES
    num_blocks, tokens = shared_layout_tokens(_groups(None), 1, budget, 64, 64)
    assert num_blocks == 101
    assert tokens == 100 * 64 // 32  # 16 blocks per group per 64-token request
    assert summed_layout_tokens(_groups(None), 1, budget, 64) == (50 - 1) * 64 // 32


def test_a_window_group_needs_only_its_span_when_steps_are_short() -> None:
    budget = 101 * 2 * PAGE_BYTES
    summed = summed_layout_tokens(_groups(8), 1, budget, 64)
    assert summed == (50 - 1) * 64 // 32
    _, at_full_step = shared_layout_tokens(_groups(8), 1, budget, 64, 64)
    _, at_small_step = shared_layout_tokens(_groups(8), 1, budget, 64, 4)
    assert at_full_step == 100 * 64 // 32  # the window spans the whole 64-token step
    # cdiv(7 + 4, 4) + 1 = 4 window blocks beside 16 full-attention ones
    assert at_small_step == 100 * 64 // (16 + 4)
    assert at_small_step > 3 * summed
