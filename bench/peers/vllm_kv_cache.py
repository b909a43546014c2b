"""The vLLM KV-cache objects both manager-level peers build: a one-group config, a block hasher.

Imported by bench/peers/vllm_kv_cache_manager.py and bench/peers/vllm_scheduler.py; runs under the
peer interpreter and never imports kvserve.
"""

from collections.abc import Callable
from typing import Any


def one_group_kv_cache_config(block_size: int, num_blocks: int) -> Any:
    """One full-attention group of one layer (2 KV heads of 16, float32), as kvserve's side has."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


def sha256_request_block_hasher(block_size: int) -> Callable[[Any], list]:
    """vLLM's per-request block hasher over sha256, its none-hash seeded first."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)
