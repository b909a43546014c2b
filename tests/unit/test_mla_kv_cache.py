"""MLAAttentionSpec end to end below the model: its wire round trip, its page (one latent per
token, never divided over TP ranks) in the engine's and the worker's capacity arithmetic, the
manager the engine gives it, and the worker's latent tensors `[num_blocks, block_size, latent_dim]`
sharing tensors by layer index with other groups."""

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine_core.kv_cache.single_type_manager import FullAttentionManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    bytes_per_block,
    num_blocks_per_request,
    plan_kv_cache,
)
from engine_core.kv_cache.spec_managers import spec_manager_class
from protocol import codec
from protocol.kv_cache_spec import page_stride_bytes
from protocol.worker_messages import WorkerHello
from tests.conftest import worker_test_device
from worker.kv_cache import allocate_kv_caches, num_blocks_in_budget
from worker.models.fake.tiny_mla import TINY_MLA
from worker.models.registry import get_model_info

DEVICE = torch.device(worker_test_device())
ENCODER = codec.make_encoder()
MLA = MLAAttentionSpec(block_size=4, latent_dim=40, dtype="float32")

mla_specs = st.builds(
    MLAAttentionSpec,
    st.integers(1, 1 << 12),
    st.integers(1, 1 << 12),
    st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
)


@given(st.integers(1, 1 << 20), st.lists(mla_specs, min_size=1, max_size=3))
def test_a_kv_cache_config_of_mla_groups_round_trips_to_the_worker(
    num_blocks: int, specs: list[MLAAttentionSpec]
) -> None:
    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    message = KVCacheConfig(num_blocks, groups)
    decoded = codec.engine_to_worker_decoder().decode(ENCODER.encode(message))
    assert decoded == message
    assert all(type(group.spec) is MLAAttentionSpec for group in decoded.kv_cache_groups)


def test_a_worker_hello_carries_tiny_mla_groups_to_the_engine() -> None:
    info = get_model_info(TINY_MLA.name, block_size=16)
    hello = WorkerHello(1, 0, 2, 123, "host", "cpu", info, 99)
    assert codec.worker_to_engine_decoder().decode(ENCODER.encode(hello)) == hello
    assert info.kv_cache_groups[0].spec == MLAAttentionSpec(16, TINY_MLA.latent_dim, "float32")


def test_an_mla_spec_with_attention_fields_is_refused_at_the_boundary() -> None:
    """A latent has no heads: a spec that claims some is malformed, not silently read."""
    wire = msgspec.to_builtins(MLA)
    wire["num_kv_heads"] = 2
    with pytest.raises(msgspec.ValidationError, match="num_kv_heads"):
        msgspec.convert(wire, MLAAttentionSpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**msgspec.to_builtins(MLA), "latent_dim": 0}, MLAAttentionSpec)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_latent_page_is_not_divided_over_tp_ranks(tp_size: int) -> None:
    # 4 tokens x 40 values x 4 bytes, on every rank
    assert MLA.page_size_bytes(tp_size) == 4 * 40 * 4
    groups = get_model_info(TINY_MLA.name, block_size=16).kv_cache_groups
    # 4 layers, each a page of 16 tokens x 40 values x 4 bytes
    assert bytes_per_block(groups, tp_size) == 4 * 16 * 40 * 4


def test_every_rank_counts_the_whole_latent_so_all_ranks_agree_on_num_blocks() -> None:
    """A sharded page would let a TP=2 rank claim twice the blocks its latents can hold."""
    groups = get_model_info(TINY_MLA.name, block_size=16).kv_cache_groups
    budget = 100 * 4 * 16 * 40 * 4 + 7
    counts = [num_blocks_in_budget(groups, tp_size, budget) for tp_size in (1, 2, 4)]
    assert counts == [100, 100, 100]
    config = plan_kv_cache(groups, counts[:2])
    assert config.num_blocks == 100


def test_the_engine_manages_mla_as_full_attention() -> None:
    assert spec_manager_class(MLA) is FullAttentionManager
    groups = [KVCacheGroupSpec(["layers.0.attn"], MLA)]
    # every block of the sequence stays, however few tokens a step schedules
    assert num_blocks_per_request(groups, 100, max_num_scheduled_tokens=8) == 25


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tiny_mla_layers_get_whole_latent_tensors_of_their_own(tp_size: int) -> None:
    info = get_model_info(TINY_MLA.name, block_size=4, dtype="float64")
    caches = allocate_kv_caches(KVCacheConfig(6, info.kv_cache_groups), tp_size, DEVICE)
    assert sorted(caches) == [TINY_MLA.layer_name(i) for i in range(TINY_MLA.num_layers)]
    storages = {cache.untyped_storage().data_ptr() for cache in caches.values()}
    assert len(storages) == TINY_MLA.num_layers
    for cache in caches.values():
        assert cache.shape == (6, 4, TINY_MLA.latent_dim) and cache.dtype == torch.float64
        assert not cache.any()


def test_mla_layers_share_tensors_by_layer_index_with_another_group() -> None:
    """Layer i of an MLA group and of an attention group view tensor i; each block row is padded
    to the larger page, so the two views of a block never overlap another block's."""
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    groups = [
        KVCacheGroupSpec(["attn.0", "attn.1"], full),  # 512-byte pages at TP=1, 256 at TP=2
        KVCacheGroupSpec(["mla.0", "mla.1"], MLA),  # 640-byte pages on every rank
    ]
    assert page_stride_bytes(groups, 2) == 640
    caches = allocate_kv_caches(KVCacheConfig(5, groups), 2, DEVICE)
    assert caches["attn.0"].shape == (5, 2, 4, 1, 8)
    assert caches["mla.0"].shape == (5, 4, 40)
    for idx in range(2):
        attn, mla = caches[f"attn.{idx}"], caches[f"mla.{idx}"]
        assert attn.untyped_storage().data_ptr() == mla.untyped_storage().data_ptr()
    caches["mla.1"][3] = 1.0  # block 3 of the MLA group
    assert caches["attn.1"][3].all() and not caches["attn.1"][2].any()
    assert not caches["attn.0"].any() and not caches["attn.1"][4].any()
