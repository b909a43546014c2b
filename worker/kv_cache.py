"""The worker's paged KV tensors: how many blocks fit, their allocation, and their shape checks.

Capacity comes from `kv_cache_memory_bytes` when given (required on the CPU, but for a checkpoint:
worker/profiling.py), else from the device's memory once the model and one profiling step have
run. Allocation uses exactly the engine's num_blocks; layer i of every KV-cache group views the
one tensor i (a block id belongs to one group at a time)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    bytes_per_block,
    num_shared_tensors,
    page_stride_bytes,
    shared_tensor_layers,
)

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
}
MIN_NUM_BLOCKS = 2  # the null block plus one usable block
GIB = 1 << 30


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {name!r}: expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class DeviceMemory(Protocol):
    """The few readings of one device that capacity needs: torch.cuda's, or a fake in tests."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes of the whole device
    def memory_reserved(self) -> int: ...  # bytes this process's caching allocator holds
    def memory_allocated(self) -> int: ...  # bytes of this process's live tensors
    def max_memory_allocated(self) -> int: ...  # peak of memory_allocated since the reset
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...  # hand cached, unused blocks back to the device


class CudaMemory:
    """DeviceMemory of one CUDA device, read through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class MemoryAtStart:
    """The device as this rank found it, before it built anything."""

    total_bytes: int
    other_bytes: int  # used, but not by this process's allocator: other processes, CUDA contexts


def memory_at_start(memory: DeviceMemory) -> MemoryAtStart:
    free_bytes, total_bytes = memory.mem_get_info()
    return MemoryAtStart(total_bytes, total_bytes - free_bytes - memory.memory_reserved())


@dataclass(frozen=True, slots=True)
class CapacitySplit:
    """How this rank's share of the device divides, in bytes."""

    share_bytes: int  # total x this rank's utilization
    other_bytes: int  # held by others when the rank started
    weights_bytes: int
    activations_bytes: int  # peak of the profiling step above the weights
    kv_budget_bytes: int  # what is left for the KV cache
    graph_bytes: int = 0  # held by the decode steps' CUDA graphs (worker/graph_runner.py)

    def describe(self) -> str:
        return (
            f"share {_gib(self.share_bytes)}: others {_gib(self.other_bytes)}, "
            f"weights {_gib(self.weights_bytes)}, activations peak "
            f"{_gib(self.activations_bytes)}, CUDA graphs {_gib(self.graph_bytes)}, "
            f"KV cache {_gib(self.kv_budget_bytes)}"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.3f} GiB"


def capacity_split(
    start: MemoryAtStart,
    weights_bytes: int,
    peak_bytes: int,
    profile_kv_bytes: int,
    utilization: float,
    graph_bytes: int = 0,
) -> CapacitySplit:
    """The KV budget: total x utilization - peak of a step - the graphs - what others held at
    start.

    `peak_bytes` was measured with the profiling step's small KV cache in place; the real cache
    replaces it, so it is taken off the peak. The graphs hold their memory beside any step's.
    """
    share_bytes = int(start.total_bytes * utilization)
    activations_bytes = max(0, peak_bytes - weights_bytes - profile_kv_bytes)
    kv_budget_bytes = (
        share_bytes - start.other_bytes - weights_bytes - activations_bytes - graph_bytes
    )
    return CapacitySplit(
        share_bytes,
        start.other_bytes,
        weights_bytes,
        activations_bytes,
        kv_budget_bytes,
        graph_bytes,
    )


def profile_capacity(
    memory: DeviceMemory,
    start: MemoryAtStart,
    run_profile_step: Callable[[], int],
    utilization: float,
    capture_graphs: Callable[[], int] | None = None,
) -> CapacitySplit:
    """Run one profiling step (it returns the bytes of its own KV cache) with the peak reset
    before it; the weights are what this process held just before. Then `capture_graphs`, when
    given, captures the decode graphs once, to be counted before the KV cache is sized: it
    returns the device bytes they held, and releases them."""
    weights_bytes = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    profile_kv_bytes = run_profile_step()
    peak_bytes = memory.max_memory_allocated()
    memory.empty_cache()  # the profiling step's cache and activations go back to the device
    graph_bytes = 0
    if capture_graphs is not None:
        graph_bytes = capture_graphs()
        memory.empty_cache()
    return capacity_split(
        start, weights_bytes, peak_bytes, profile_kv_bytes, utilization, graph_bytes
    )


def num_blocks_in_budget(
    kv_cache_groups: list[KVCacheGroupSpec], tp_size: int, budget_bytes: int
) -> int:
    """Blocks a budget holds: each block id takes one page in every shared tensor."""
    per_block = bytes_per_block(kv_cache_groups, tp_size)
    num_blocks = max(0, budget_bytes) // per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {per_block} bytes, "
            f"expected at least {MIN_NUM_BLOCKS}"
        )
    return num_blocks


def allocate_kv_caches(
    kv_cache_config: KVCacheConfig, tp_size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each layer's view [num_blocks, 2, block_size, num_kv_heads_per_rank, head_dim] of a zeroed
    shared tensor (an MLA layer's [num_blocks, block_size, latent_dim], a Mamba layer's
    [num_blocks, *state_shape_per_rank]): layer i of every group views tensor i.

    The null block 0 stays zero in every view because no group ever writes it.
    """
    groups = kv_cache_config.kv_cache_groups
    num_blocks = kv_cache_config.num_blocks
    stride_bytes = page_stride_bytes(groups, tp_size)
    specs: dict[str, KVCacheSpec] = {}
    for group in groups:
        for name in group.layer_names:
            if name in specs:
                raise ValueError(f"layer {name} appears in two KV-cache groups")
            specs[name] = group.spec
    kv_caches: dict[str, torch.Tensor] = {}
    for layer_names in shared_tensor_layers(groups):
        # [num_blocks, page_stride_bytes]: one page of one group's layer per block
        shared = torch.zeros((num_blocks, stride_bytes), dtype=torch.uint8, device=device)
        for name in layer_names:
            kv_caches[name] = _layer_view(shared, specs[name], tp_size)
    logger.info(
        "allocated %d shared KV tensors for %d layers x %d blocks (%d bytes per block) on %s",
        num_shared_tensors(groups),
        len(kv_caches),
        num_blocks,
        bytes_per_block(groups, tp_size),
        device,
    )
    return kv_caches


def shared_kv_tensors(
    kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor], tp_size: int
) -> list[torch.Tensor]:
    """The shared tensors under the layer views, as allocated: tensor i is the storage of the
    i-th layer of every group. Whole pages are copied through them (worker/kv_tiers.py)."""
    groups = kv_cache_config.kv_cache_groups
    shape = (kv_cache_config.num_blocks, page_stride_bytes(groups, tp_size))
    tensors = []
    for layer_names in shared_tensor_layers(groups):
        storage = kv_caches[layer_names[0]].untyped_storage()
        if storage.nbytes() != shape[0] * shape[1]:
            raise ValueError(
                f"layer {layer_names[0]} views {storage.nbytes()} bytes, expected {shape}"
            )
        # [num_blocks, page_stride_bytes]: the tensor allocate_kv_caches made
        shared = torch.empty(0, dtype=torch.uint8, device=storage.device)
        tensors.append(shared.set_(storage, 0, shape, (shape[1], 1)))
    return tensors


def layer_page_shape(spec: KVCacheSpec, tp_size: int) -> tuple[int, ...]:
    """The shape of one block of one layer on one rank, below the num_blocks dimension."""
    match spec:
        case MLAAttentionSpec():
            return (spec.block_size, spec.latent_dim)  # the whole latent: no K/V, not sharded
        case MambaSpec():  # one state per block, its first dimension split over the ranks
            if len(spec.state_shapes) != 1:
                raise ValueError(
                    f"a Mamba layer with {len(spec.state_shapes)} state tensors: the worker "
                    f"views exactly one per layer"
                )
            first, *rest = spec.state_shapes[0]
            if first % tp_size:
                raise ValueError(
                    f"mamba state shape {spec.state_shapes[0]} is not divisible by "
                    f"tp_size={tp_size} in its first dimension"
                )
            return (first // tp_size, *rest)
        case _:
            return (2, spec.block_size, spec.num_kv_heads_per_rank(tp_size), spec.head_dim)


def _layer_view(shared: torch.Tensor, spec: KVCacheSpec, tp_size: int) -> torch.Tensor:
    """One layer's typed view of a shared byte tensor; its page is the front of each block row."""
    shape = layer_page_shape(spec, tp_size)
    page = shared[:, : spec.page_size_bytes(tp_size)]  # [num_blocks, page_size_bytes]
    # attention: [num_blocks, 2 (K, V), block_size, num_kv_heads_per_rank, head_dim]
    # MLA: [num_blocks, block_size, latent_dim]
    # Mamba: [num_blocks, state channels per rank, *the rest of the state shape]
    view = page.view(torch_dtype(spec.dtype)).unflatten(1, shape)
    assert view.shape[1:] == shape, f"a {spec} page viewed as {tuple(view.shape)}"
    return view


def check_kv_caches(kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]) -> None:
    """Every layer's tensor has the agreed shape, and its null block was never written."""
    num_blocks = kv_cache_config.num_blocks
    for group in kv_cache_config.kv_cache_groups:
        spec = group.spec
        for name in group.layer_names:
            cache = kv_caches[name]
            shape = tuple(cache.shape)
            match spec:
                case MLAAttentionSpec():  # the whole latent on every rank: no K/V, no heads
                    expected = (num_blocks, spec.block_size, spec.latent_dim)
                    assert shape == expected, f"layer {name} cache is {shape}, not {expected}"
                case MambaSpec():  # one state per block, channels split over the ranks
                    (first, *rest) = spec.state_shapes[0]
                    assert (
                        shape[0] == num_blocks and list(shape[2:]) == rest and first % shape[1] == 0
                    ), (
                        f"layer {name} cache is {shape}, expected ({num_blocks}, {first} / "
                        f"tp_size, *{rest})"
                    )
                case _:
                    assert (
                        len(shape) == 5
                        and shape[:3] == (num_blocks, 2, spec.block_size)
                        and shape[4] == spec.head_dim
                    ), (
                        f"layer {name} cache is {shape}, expected ({num_blocks}, 2, "
                        f"{spec.block_size}, num_kv_heads_per_rank, {spec.head_dim})"
                    )
            assert not cache[NULL_BLOCK_ID].any(), f"layer {name} wrote into the null block"
    for layer_names in shared_tensor_layers(kv_cache_config.kv_cache_groups):
        storages = {kv_caches[name].untyped_storage().data_ptr() for name in layer_names}
        assert len(storages) == 1, f"layers {layer_names} should share one tensor"
