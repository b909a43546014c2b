"""Tiny KV-cache specs for the manager and coordinator tests: block size 2, one head of dim 4."""

from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)

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
