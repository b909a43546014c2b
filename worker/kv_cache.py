"""The worker's paged KV tensors: how many blocks fit, and their allocation per layer.

Capacity comes from `kv_cache_memory_bytes` when given (required on the CPU), otherwise from
`gpu_memory_utilization` of the CUDA device. Allocation uses exactly the num_blocks the engine sent.
"""

import logging

import torch

from protocol.kv_cache_spec import KVCacheConfig, KVCacheGroupSpec, bytes_per_block

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}
MIN_NUM_BLOCKS = 2  # the null block plus one usable block


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {name!r}: expected one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def kv_cache_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, kv_cache_memory_bytes: int | None
) -> int:
    """Bytes this rank may give the KV cache."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if device.type != "cuda":
        raise ValueError(f"kv_cache_memory_bytes is required on device {device}, got None")
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    used_bytes = total_bytes - free_bytes  # weights, activations and other processes
    return int(total_bytes * gpu_memory_utilization) - used_bytes


def num_blocks_available(
    kv_cache_groups: list[KVCacheGroupSpec],
    tp_size: int,
    device: torch.device,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
) -> int:
    """Blocks this rank can hold: every layer of every group keeps a page per block id."""
    per_block = bytes_per_block(kv_cache_groups, tp_size)
    budget = kv_cache_budget_bytes(device, gpu_memory_utilization, kv_cache_memory_bytes)
    num_blocks = budget // per_block
    if num_blocks < MIN_NUM_BLOCKS:
        raise ValueError(
            f"a KV budget of {budget} bytes holds {num_blocks} blocks of {per_block} bytes, "
            f"expected at least {MIN_NUM_BLOCKS}"
        )
    return num_blocks


def allocate_kv_caches(
    kv_cache_config: KVCacheConfig, tp_size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """One zeroed tensor per layer; the null block 0 stays zero because nothing writes it."""
    kv_caches: dict[str, torch.Tensor] = {}
    num_blocks = kv_cache_config.num_blocks
    for group in kv_cache_config.kv_cache_groups:
        spec = group.spec
        shape = (
            num_blocks,
            2,
            spec.block_size,
            spec.num_kv_heads_per_rank(tp_size),
            spec.head_dim,
        )
        for name in group.layer_names:
            if name in kv_caches:
                raise ValueError(f"layer {name} appears in two KV-cache groups")
            # [num_blocks, 2 (K, V), block_size, num_kv_heads_per_rank, head_dim]
            tensor = torch.zeros(shape, dtype=torch_dtype(spec.dtype), device=device)
            assert tuple(tensor.shape) == shape, f"layer {name} got shape {tuple(tensor.shape)}"
            kv_caches[name] = tensor
    logger.info(
        "allocated %d layers x %d blocks (%d bytes per block) on %s",
        len(kv_caches),
        num_blocks,
        bytes_per_block(kv_cache_config.kv_cache_groups, tp_size),
        device,
    )
    return kv_caches
