"""Capacity measurement and allocation of the worker's paged KV tensors: one tensor per layer
index, shared by the layers of that index in every group, each layer reading its own view."""

import pytest
import torch

from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    bytes_per_block,
)
from tests.conftest import worker_test_device
from worker.kv_cache import (
    CudaMemory,
    MemoryAtStart,
    allocate_kv_caches,
    capacity_split,
    memory_at_start,
    num_blocks_in_budget,
    profile_capacity,
)
from worker.models.registry import get_model_info

DEVICE = torch.device(worker_test_device())
MIB = 1 << 20


def test_cpu_capacity_divides_the_byte_budget_by_the_bytes_per_block() -> None:
    groups = get_model_info("tiny-llama-hybrid", block_size=4).kv_cache_groups
    # 2 shared tensors (2 layers a group) x K, V x 4 tokens x 2 heads per rank x 16 dims x 4 bytes
    assert bytes_per_block(groups, tp_size=2) == 2 * 2 * 4 * 2 * 16 * 4
    budget = 10 * 2048 + 100
    assert num_blocks_in_budget(groups, 2, budget) == 10
    assert num_blocks_in_budget(groups, 1, budget) == 5


def test_the_hybrid_holds_twice_the_blocks_of_a_page_in_every_layer_of_every_group() -> None:
    """Before the shared layout a block id took a page in all 4 layers; now in 2 tensors."""
    groups = get_model_info("tiny-llama-hybrid", block_size=16).kv_cache_groups
    page_bytes = groups[0].spec.page_size_bytes(1)
    budget = 1000 * 4 * page_bytes
    assert num_blocks_in_budget(groups, 1, budget) == 2000


@pytest.mark.parametrize("budget_offset", [1, -(1 << 30)])
def test_a_budget_below_two_blocks_is_rejected(budget_offset: int) -> None:
    """A negative budget (the device is already full) is refused, not turned into blocks."""
    groups = get_model_info("checksum", block_size=4).kv_cache_groups
    per_block = bytes_per_block(groups, 1)
    with pytest.raises(ValueError, match=r"holds [01] blocks .* expected at least 2"):
        num_blocks_in_budget(groups, 1, per_block + budget_offset)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_allocation_gives_every_layer_its_rank_shard(tp_size: int) -> None:
    info = get_model_info("tiny-llama-hybrid", block_size=4, dtype="float64")
    config = KVCacheConfig(num_blocks=6, kv_cache_groups=info.kv_cache_groups)
    caches = allocate_kv_caches(config, tp_size, DEVICE)
    assert sorted(caches) == [f"layers.{i}.attn" for i in range(4)]
    for tensor in caches.values():
        assert tuple(tensor.shape) == (6, 2, 4, 4 // tp_size, 16)
        assert tensor.dtype == torch.float64
        assert not tensor.any()


def test_layer_i_of_each_group_views_the_one_tensor_i() -> None:
    """tiny-llama-hybrid: full layers 0, 2 and sliding layers 1, 3; layers 0 and 1 share tensor
    0, layers 2 and 3 tensor 1, so a write to block 3 through layer 0 is read through layer 1."""
    info = get_model_info("tiny-llama-hybrid", block_size=4, dtype="float32")
    caches = allocate_kv_caches(KVCacheConfig(5, info.kv_cache_groups), 1, DEVICE)
    storages = {name: tensor.untyped_storage().data_ptr() for name, tensor in caches.items()}
    assert storages["layers.0.attn"] == storages["layers.1.attn"]
    assert storages["layers.2.attn"] == storages["layers.3.attn"]
    assert storages["layers.0.attn"] != storages["layers.2.attn"]
    total_bytes = sum(
        caches[name].untyped_storage().nbytes() for name in ("layers.0.attn", "layers.2.attn")
    )
    assert total_bytes == 5 * bytes_per_block(info.kv_cache_groups, 1)
    caches["layers.0.attn"][3, 1, 2, 0, 5] = 7.0
    assert caches["layers.1.attn"][3, 1, 2, 0, 5] == 7.0
    assert not caches["layers.2.attn"].any() and not caches["layers.3.attn"].any()
    assert not any(tensor[0].any() for tensor in caches.values()), "the null block stays zero"


def test_groups_of_different_page_sizes_view_the_front_of_each_padded_block() -> None:
    """A half-size page (fewer KV heads) reads the first half of each block's bytes."""
    wide = FullAttentionSpec(block_size=2, num_kv_heads=2, head_dim=4, dtype="float32")
    narrow = SlidingWindowSpec(
        block_size=2, num_kv_heads=1, head_dim=4, dtype="float32", sliding_window=4
    )
    groups = [KVCacheGroupSpec(["wide"], wide), KVCacheGroupSpec(["narrow"], narrow)]
    caches = allocate_kv_caches(KVCacheConfig(3, groups), 1, DEVICE)
    assert tuple(caches["wide"].shape) == (3, 2, 2, 2, 4)
    assert tuple(caches["narrow"].shape) == (3, 2, 2, 1, 4)
    assert caches["narrow"].stride(0) == caches["wide"].stride(0) == 32  # floats per block
    values = torch.arange(16, dtype=torch.float32, device=DEVICE)
    caches["narrow"][2] = values.view(2, 2, 1, 4)
    assert torch.equal(caches["wide"][2].flatten()[:16], values)
    assert not caches["wide"][2].flatten()[16:].any() and not caches["wide"][1].any()


def test_checksum_stores_int64_values() -> None:
    info = get_model_info("checksum", block_size=2)
    caches = allocate_kv_caches(KVCacheConfig(3, info.kv_cache_groups), 2, DEVICE)
    assert {tensor.dtype for tensor in caches.values()} == {torch.int64}
    assert {tuple(tensor.shape) for tensor in caches.values()} == {(3, 2, 2, 2, 2)}


def test_allocation_rejects_a_tp_size_that_does_not_divide_the_heads() -> None:
    info = get_model_info("tiny-llama", block_size=4)
    with pytest.raises(ValueError, match="num_kv_heads=4 is not divisible by tp_size=3"):
        allocate_kv_caches(KVCacheConfig(3, info.kv_cache_groups), 3, DEVICE)


def test_a_layer_in_two_groups_is_rejected() -> None:
    info = get_model_info("tiny-llama", block_size=4)
    groups = [info.kv_cache_groups[0], info.kv_cache_groups[0]]
    with pytest.raises(ValueError, match="appears in two KV-cache groups"):
        allocate_kv_caches(KVCacheConfig(3, groups), 1, DEVICE)


def test_model_info_names_and_groups() -> None:
    hybrid = get_model_info("tiny-llama-hybrid", block_size=16)
    assert [len(g.layer_names) for g in hybrid.kv_cache_groups] == [2, 2]
    assert hybrid.kv_cache_groups[1].spec.sliding_window == 48
    assert len(get_model_info("tiny-llama", 16).kv_cache_groups) == 1
    assert get_model_info("checksum", 16).eos_token_ids == []
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        get_model_info("gpt", 16)


class FakeMemory:
    """A device of `total` bytes: others hold some, this process allocates as the test says."""

    def __init__(self, total: int, others: int, reserved: int = 0) -> None:
        self.total, self.others, self.reserved = total, others, reserved
        self.allocated, self.peak = 0, 0
        self.calls: list[str] = []

    def allocate(self, num_bytes: int) -> None:
        self.allocated += num_bytes
        self.peak = max(self.peak, self.allocated)

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.others - self.reserved, self.total

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        self.calls.append("peak")
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset")
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self.calls.append("empty")


def test_memory_held_at_start_by_others_excludes_this_processes_allocator() -> None:
    memory = FakeMemory(total=1000 * MIB, others=150 * MIB, reserved=30 * MIB)
    assert memory_at_start(memory) == MemoryAtStart(1000 * MIB, 150 * MIB)


def test_kv_budget_is_the_share_less_peak_and_others() -> None:
    start = MemoryAtStart(total_bytes=1000 * MIB, other_bytes=100 * MIB)
    # peak 300 MiB: 200 of weights, 4 of the profiling cache, 96 of activations
    split = capacity_split(start, 200 * MIB, 300 * MIB, 4 * MIB, utilization=0.9)
    assert split.share_bytes == 900 * MIB
    assert split.activations_bytes == 96 * MIB
    assert split.kv_budget_bytes == (900 - 100 - 200 - 96) * MIB
    assert "KV cache 0.492 GiB" in split.describe()


def test_profiling_resets_the_peak_after_the_weights_and_reads_it_after_the_step() -> None:
    memory = FakeMemory(total=1000 * MIB, others=100 * MIB)
    start = memory_at_start(memory)
    memory.allocate(200 * MIB)  # the weights
    memory.peak = 900 * MIB  # a spike while building the model must not count

    def step() -> int:
        memory.allocate(50 * MIB)  # the step's cache and activations
        memory.allocated -= 50 * MIB
        return 10 * MIB

    split = profile_capacity(memory, start, step, utilization=0.5)
    assert memory.calls == ["reset", "peak", "empty"]
    assert (split.weights_bytes, split.activations_bytes) == (200 * MIB, 40 * MIB)
    assert split.kv_budget_bytes == (500 - 100 - 200 - 40) * MIB


def test_graphs_captured_after_the_step_come_off_the_budget_and_not_the_activations() -> None:
    memory = FakeMemory(total=1000 * MIB, others=100 * MIB)
    start = memory_at_start(memory)
    memory.allocate(200 * MIB)  # the weights

    def step() -> int:
        memory.allocate(50 * MIB)
        memory.allocated -= 50 * MIB
        return 10 * MIB

    def capture_graphs() -> int:
        memory.calls.append("capture")
        return 30 * MIB  # what the graphs held, measured by the capture itself

    split = profile_capacity(memory, start, step, 0.5, capture_graphs)
    assert memory.calls == ["reset", "peak", "empty", "capture", "empty"]
    assert (split.activations_bytes, split.graph_bytes) == (40 * MIB, 30 * MIB)
    assert split.kv_budget_bytes == (500 - 100 - 200 - 40 - 30) * MIB
    assert "CUDA graphs 0.029 GiB" in split.describe()


def test_a_device_full_at_start_leaves_a_negative_budget_that_holds_no_blocks() -> None:
    start = MemoryAtStart(total_bytes=1000 * MIB, other_bytes=800 * MIB)
    split = capacity_split(start, 100 * MIB, 150 * MIB, 0, utilization=0.9)
    assert split.kv_budget_bytes == (900 - 800 - 150) * MIB < 0
    groups = get_model_info("tiny-llama", block_size=16).kv_cache_groups
    with pytest.raises(ValueError, match="expected at least 2"):
        num_blocks_in_budget(groups, 1, split.kv_budget_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_readings_follow_an_allocation() -> None:
    device = torch.device("cuda", 0)
    memory = CudaMemory(device)
    start = memory_at_start(memory)
    assert 0 <= start.other_bytes < start.total_bytes
    before = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    tensor = torch.empty(64 * MIB, dtype=torch.uint8, device=device)  # [64 MiB]
    assert memory.memory_allocated() - before >= 64 * MIB
    del tensor
    assert memory.max_memory_allocated() - before >= 64 * MIB
    groups = get_model_info("tiny-llama", block_size=16).kv_cache_groups
    caches = allocate_kv_caches(KVCacheConfig(4, groups), 1, device)
    assert all(tensor.is_cuda and tensor.shape[0] == 4 for tensor in caches.values())
