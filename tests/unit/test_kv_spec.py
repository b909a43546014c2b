"""KV-cache specs and planning: the shared layout's bytes per block, the blocks one request holds
(a sliding window's as its window needs them), the minimum over ranks, and the refusal to plan."""

import pytest

from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    bytes_per_block,
    cdiv,
    describe_capacity,
    num_blocks_per_request,
    num_window_blocks,
    plan_kv_cache,
    resolve_hash_block_size,
)
from protocol.kv_cache_spec import num_shared_tensors, page_stride_bytes, shared_tensor_layers

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
WINDOW = SlidingWindowSpec(
    block_size=4, num_kv_heads=2, head_dim=8, dtype="float32", sliding_window=8
)


def _groups() -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec(layer_names=["layers.0", "layers.1"], spec=FULL)]


def test_spec_reports_bytes_per_block_for_k_and_v() -> None:
    # 2 (K and V) * 4 tokens * 2 heads * 8 dims * 4 bytes
    assert FULL.page_size_bytes() == 512
    assert FULL.page_size_bytes(tp_size=2) == 256
    assert WINDOW.page_size_bytes() == 512


def test_a_block_costs_one_page_per_layer_of_the_largest_group() -> None:
    """The layout vLLM uses: a block id serves one group at a time, so it needs a page in as many
    tensors as the largest group has layers, not a page in every layer of every group."""
    groups = [
        KVCacheGroupSpec(layer_names=["a", "b"], spec=FULL),
        KVCacheGroupSpec(layer_names=["c"], spec=WINDOW),
    ]
    assert num_shared_tensors(groups) == 2
    assert bytes_per_block(groups, tp_size=1) == 2 * 512
    assert bytes_per_block(groups, tp_size=2) == 2 * 256
    assert bytes_per_block(groups[:1], tp_size=1) == 2 * 512  # one group: as before


def test_layer_i_of_every_group_shares_tensor_i() -> None:
    groups = [
        KVCacheGroupSpec(layer_names=["full.0", "full.1", "full.2"], spec=FULL),
        KVCacheGroupSpec(layer_names=["window.0", "window.1"], spec=WINDOW),
    ]
    assert shared_tensor_layers(groups) == [
        ["full.0", "window.0"],
        ["full.1", "window.1"],
        ["full.2"],
    ]


def test_pages_of_different_sizes_are_padded_to_the_largest_aligned_page() -> None:
    """A half page pads to the full one; a 20-byte float16 page beside a float64 one pads to 24
    bytes, so that every block of the float64 layer starts on an 8-byte boundary."""
    half = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_dim=8, dtype="float32", sliding_window=8
    )
    groups = [KVCacheGroupSpec(["a"], FULL), KVCacheGroupSpec(["b"], half)]
    assert half.page_size_bytes() == 256
    assert page_stride_bytes(groups, 1) == 512 and bytes_per_block(groups, 1) == 512
    narrow = FullAttentionSpec(block_size=1, num_kv_heads=1, head_dim=5, dtype="float16")
    wide = FullAttentionSpec(block_size=1, num_kv_heads=1, head_dim=1, dtype="float64")
    odd = [KVCacheGroupSpec(["a"], narrow), KVCacheGroupSpec(["b"], wide)]
    assert (narrow.page_size_bytes(), wide.page_size_bytes()) == (20, 16)
    assert page_stride_bytes(odd, 1) == 24


def test_cdiv_rounds_up() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_plan_picks_the_minimum_over_ranks() -> None:
    config = plan_kv_cache(_groups(), [40, 25])
    assert config == KVCacheConfig(num_blocks=25, kv_cache_groups=_groups())
    # 24 usable blocks (block 0 is the null block) of 4 tokens; 4 blocks per request of 16
    assert describe_capacity(config, 16, num_blocks_per_request(_groups(), 16)) == (
        "KV cache holds 96 tokens; max concurrency 6.00 at max_model_len 16"
    )


def test_plan_override_replaces_the_measured_count() -> None:
    config = plan_kv_cache(_groups(), [100], num_gpu_blocks_override=9)
    assert config.num_blocks == 9
    assert describe_capacity(config, 16, num_blocks_per_request(_groups(), 16)) == (
        "KV cache holds 32 tokens; max concurrency 2.00 at max_model_len 16"
    )


def test_a_whole_reservation_counts_a_block_per_group_for_every_position() -> None:
    """With no per-step bound (the scheduler reserves the whole prompt) a window frees nothing."""
    groups = [
        KVCacheGroupSpec(layer_names=["full.0"], spec=FULL),
        KVCacheGroupSpec(layer_names=["window.0"], spec=WINDOW),
    ]
    assert num_blocks_per_request(groups, 16) == 8
    # 16 usable blocks, 8 per request of 16 tokens
    assert describe_capacity(plan_kv_cache(groups, [17]), 16, 8) == (
        "KV cache holds 32 tokens; max concurrency 2.00 at max_model_len 16"
    )


def test_a_sliding_window_group_counts_only_the_blocks_its_window_needs() -> None:
    """Window 8, blocks of 4, up to 4 tokens a step: 7 + 4 tokens span at most 4 blocks."""
    groups = [
        KVCacheGroupSpec(layer_names=["full.0"], spec=FULL),
        KVCacheGroupSpec(layer_names=["window.0"], spec=WINDOW),
    ]
    assert num_window_blocks(WINDOW, 4) == 4
    assert num_blocks_per_request(groups, 64, max_num_scheduled_tokens=4) == 16 + 4
    assert num_blocks_per_request(groups, 64, max_num_scheduled_tokens=32) == 16 + 11
    # never more than the sequence itself has blocks
    assert num_blocks_per_request(groups, 8, max_num_scheduled_tokens=4) == 2 + 2
    # 60 usable blocks, 20 per request of 64 tokens
    assert describe_capacity(plan_kv_cache(groups, [61]), 64, 20) == (
        "KV cache holds 192 tokens; max concurrency 3.00 at max_model_len 64"
    )


@pytest.mark.parametrize("num_blocks_per_rank", [[], [-1], [4, -1]])
def test_plan_rejects_missing_or_negative_capacities(num_blocks_per_rank: list[int]) -> None:
    with pytest.raises(ValueError, match="expected a count per rank, none negative"):
        plan_kv_cache(_groups(), num_blocks_per_rank)


def test_plan_takes_groups_of_different_block_sizes_over_their_gcd() -> None:
    other = FullAttentionSpec(block_size=8, num_kv_heads=2, head_dim=8, dtype="float32")
    groups = [*_groups(), KVCacheGroupSpec(layer_names=["x"], spec=other)]
    assert plan_kv_cache(groups, [100]).num_blocks == 100
    assert resolve_hash_block_size(groups) == 4
    # Each group counts its own blocks: 64 tokens are 16 blocks of 4 and 8 blocks of 8.
    assert num_blocks_per_request(groups, max_model_len=64) == 16 + 8
