"""Capacity measurement and per-layer allocation of the worker's paged KV tensors."""

import pytest
import torch

from protocol.kv_cache_spec import KVCacheConfig, bytes_per_block
from worker.kv_cache import allocate_kv_caches, num_blocks_available
from worker.models.registry import get_model_info

CPU = torch.device("cpu")


def test_cpu_capacity_divides_the_byte_budget_by_the_bytes_per_block() -> None:
    groups = get_model_info("tiny-llama-hybrid", block_size=4).kv_cache_groups
    # 4 layers x K and V x 4 tokens x 2 heads per rank x 16 dims x 4 bytes
    assert bytes_per_block(groups, tp_size=2) == 4 * 2 * 4 * 2 * 16 * 4
    budget = 10 * 4096 + 100
    assert num_blocks_available(groups, 2, CPU, 0.9, budget) == 10
    assert num_blocks_available(groups, 1, CPU, 0.9, budget) == 5


def test_cpu_capacity_needs_a_byte_budget() -> None:
    groups = get_model_info("checksum", block_size=4).kv_cache_groups
    with pytest.raises(ValueError, match="kv_cache_memory_bytes is required on device cpu"):
        num_blocks_available(groups, 1, CPU, 0.9, None)


def test_a_budget_below_two_blocks_is_rejected() -> None:
    groups = get_model_info("checksum", block_size=4).kv_cache_groups
    per_block = bytes_per_block(groups, 1)
    with pytest.raises(ValueError, match=r"holds 1 blocks .* expected at least 2"):
        num_blocks_available(groups, 1, CPU, 0.9, per_block + 1)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_allocation_gives_every_layer_its_rank_shard(tp_size: int) -> None:
    info = get_model_info("tiny-llama-hybrid", block_size=4, dtype="float64")
    config = KVCacheConfig(num_blocks=6, kv_cache_groups=info.kv_cache_groups)
    caches = allocate_kv_caches(config, tp_size, CPU)
    assert sorted(caches) == [f"layers.{i}.attn" for i in range(4)]
    for tensor in caches.values():
        assert tuple(tensor.shape) == (6, 2, 4, 4 // tp_size, 16)
        assert tensor.dtype == torch.float64
        assert not tensor.any()


def test_checksum_stores_int64_values() -> None:
    info = get_model_info("checksum", block_size=2)
    caches = allocate_kv_caches(KVCacheConfig(3, info.kv_cache_groups), 2, CPU)
    assert {tensor.dtype for tensor in caches.values()} == {torch.int64}
    assert {tuple(tensor.shape) for tensor in caches.values()} == {(3, 2, 2, 2, 2)}


def test_allocation_rejects_a_tp_size_that_does_not_divide_the_heads() -> None:
    info = get_model_info("tiny-llama", block_size=4)
    with pytest.raises(ValueError, match="num_kv_heads=4 is not divisible by tp_size=3"):
        allocate_kv_caches(KVCacheConfig(3, info.kv_cache_groups), 3, CPU)


def test_a_layer_in_two_groups_is_rejected() -> None:
    info = get_model_info("tiny-llama", block_size=4)
    groups = [info.kv_cache_groups[0], info.kv_cache_groups[0]]
    with pytest.raises(ValueError, match="appears in two KV-cache groups"):
        allocate_kv_caches(KVCacheConfig(3, groups), 1, CPU)


def test_model_info_names_and_groups() -> None:
    hybrid = get_model_info("tiny-llama-hybrid", block_size=16)
    assert [len(g.layer_names) for g in hybrid.kv_cache_groups] == [2, 2]
    assert hybrid.kv_cache_groups[1].spec.sliding_window == 48
    assert len(get_model_info("tiny-llama", 16).kv_cache_groups) == 1
    assert get_model_info("checksum", 16).eos_token_id is None
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        get_model_info("gpt", 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capacity_takes_its_share_of_the_device_less_what_is_in_use() -> None:
    device = torch.device("cuda", 0)
    groups = get_model_info("tiny-llama", block_size=16).kv_cache_groups
    per_block = bytes_per_block(groups, 1)
    free_before, total_bytes = torch.cuda.mem_get_info(device)
    got = num_blocks_available(groups, 1, device, 0.5, None)
    free_after, _ = torch.cuda.mem_get_info(device)
    share = int(total_bytes * 0.5)
    # another process may allocate or free in between: bound by both readings of the free memory
    lowest = (share - (total_bytes - min(free_before, free_after))) // per_block
    highest = (share - (total_bytes - max(free_before, free_after))) // per_block
    assert lowest <= got <= highest
    assert num_blocks_available(groups, 1, device, 0.5, 10 * per_block) == 10
    caches = allocate_kv_caches(KVCacheConfig(4, groups), 1, device)
    assert all(tensor.is_cuda and tensor.shape[0] == 4 for tensor in caches.values())
