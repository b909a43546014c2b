"""Tiny KV-cache specs for the manager and coordinator tests (block size 2, one head of dim 4),
configs of one group per spec, and requests whose blocks are hashed."""

from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2


def full_spec(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=4, dtype="float32")


def window_spec(sliding_window: int, block_size: int = BLOCK_SIZE) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        sliding_window=sliding_window,
    )


def chunked_local_spec(
    attention_chunk_size: int, block_size: int = BLOCK_SIZE
) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        attention_chunk_size=attention_chunk_size,
    )


def rswa_spec(rswa_window: int, block_size: int = BLOCK_SIZE) -> RSWASpec:
    return RSWASpec(
        block_size=block_size, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=rswa_window
    )


def kv_cache_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """One group per spec, its one layer named g0, g1, ... in order."""
    groups = [KVCacheGroupSpec(layer_names=[f"g{idx}"], spec=s) for idx, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def hashed_request(req_id: str, token_ids: list[int], block_size: int = BLOCK_SIZE) -> Request:
    """A request with default sampling params whose full blocks of block_size are hashed."""
    return Request(req_id, token_ids, SamplingParams(), block_hasher=BlockHasher(block_size))
