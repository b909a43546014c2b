"""KV-cache specs and planning: bytes per block, the minimum over ranks, and the refusal to plan."""

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
    plan_kv_cache,
)

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


def test_bytes_per_block_sums_every_layer_of_every_group() -> None:
    groups = [
        KVCacheGroupSpec(layer_names=["a", "b"], spec=FULL),
        KVCacheGroupSpec(layer_names=["c"], spec=WINDOW),
    ]
    assert bytes_per_block(groups, tp_size=1) == 3 * 512


def test_cdiv_rounds_up() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_plan_picks_the_minimum_over_ranks() -> None:
    config = plan_kv_cache(_groups(), [40, 25])
    assert config == KVCacheConfig(num_blocks=25, kv_cache_groups=_groups())
    # 24 usable blocks (block 0 is the null block) of 4 tokens; 4 blocks per request of 16
    assert describe_capacity(config, 16) == (
        "KV cache holds 96 tokens; max concurrency 6.00 at max_model_len 16"
    )


def test_plan_override_replaces_the_measured_count() -> None:
    config = plan_kv_cache(_groups(), [100], num_gpu_blocks_override=9)
    assert config.num_blocks == 9
    assert describe_capacity(config, 16) == (
        "KV cache holds 32 tokens; max concurrency 2.00 at max_model_len 16"
    )


def test_hybrid_capacity_counts_a_block_per_group_for_every_position() -> None:
    groups = [
        KVCacheGroupSpec(layer_names=["full.0"], spec=FULL),
        KVCacheGroupSpec(layer_names=["window.0"], spec=WINDOW),
    ]
    assert num_blocks_per_request(groups, 16) == 8
    # 16 usable blocks shared by two groups hold 32 token positions
    assert describe_capacity(plan_kv_cache(groups, [17]), 16) == (
        "KV cache holds 32 tokens; max concurrency 2.00 at max_model_len 16"
    )


@pytest.mark.parametrize("num_blocks_per_rank", [[], [-1], [4, -1]])
def test_plan_rejects_missing_or_negative_capacities(num_blocks_per_rank: list[int]) -> None:
    with pytest.raises(ValueError, match="expected a count per rank, none negative"):
        plan_kv_cache(_groups(), num_blocks_per_rank)


def test_plan_rejects_groups_of_different_block_sizes() -> None:
    other = FullAttentionSpec(block_size=8, num_kv_heads=2, head_dim=8, dtype="float32")
    groups = [*_groups(), KVCacheGroupSpec(layer_names=["x"], spec=other)]
    with pytest.raises(ValueError, match=r"block sizes \[4, 8\]"):
        plan_kv_cache(groups, [1 << 20])
