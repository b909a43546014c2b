"""KV-cache specs and the plan that turns every rank's free memory into one KVCacheConfig.

The spec Structs live in protocol/ (the worker allocates from them); this module re-exports them
and owns the capacity arithmetic. It never touches a tensor.
"""

import logging

from engine_core.kv_cache.hashing import get_hash_block_size
from protocol.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
    bytes_per_block,
    cdiv,
)

__all__ = [
    "PREFIX_ATTENTION_SPECS",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "RSWASpec",
    "SlidingWindowSpec",
    "bytes_per_block",
    "cdiv",
    "describe_capacity",
    "num_blocks_per_request",
    "num_chunk_blocks",
    "num_group_blocks_per_request",
    "num_window_blocks",
    "plan_kv_cache",
    "resolve_hash_block_size",
]

logger = logging.getLogger(__name__)

# Specs whose layers read every earlier token: a hit is a run of blocks from token 0, managed by
# FullAttentionManager (an MLA layer reads the whole prefix of latents, as vLLM's MLA spec is a
# full-attention spec), searched first in a hybrid model and the group a junction is measured in.
PREFIX_ATTENTION_SPECS = (FullAttentionSpec, MLAAttentionSpec)

NUM_NULL_BLOCKS = 1  # block 0 is the placeholder for skipped positions and holds no tokens


def num_blocks_per_request(
    kv_cache_groups: list[KVCacheGroupSpec],
    max_model_len: int,
    max_num_scheduled_tokens: int | None = None,
) -> int:
    """Blocks one request of `max_model_len` tokens holds from the shared pool at its peak.

    Each group holds its own blocks (a block id serves one group at a time). A full-attention
    group holds one per block of the sequence; a sliding-window group, see `num_window_blocks`.

    Args:
        max_num_scheduled_tokens: the most tokens one request is given in one step; None when
            a request may reserve its whole sequence at once (the scheduler's reserve_full_prompt).
    """
    return sum(
        num_group_blocks_per_request(group.spec, max_model_len, max_num_scheduled_tokens)
        for group in kv_cache_groups
    )


def num_group_blocks_per_request(
    spec: KVCacheSpec, max_model_len: int, max_num_scheduled_tokens: int | None
) -> int:
    """Blocks one request holds in one group at its peak (see `num_blocks_per_request`)."""
    if isinstance(spec, CrossAttentionSpec):
        # Encoder K/V, held whole from admission: its length is the encoder's, not the sequence's.
        return cdiv(spec.max_num_encoder_tokens, spec.block_size)
    if isinstance(spec, MambaSpec):
        # One running state block; "align" also keeps the state the step starts from (a hit or
        # the last step's) beside the new one, until the next step frees it (mamba_manager.py).
        num_state_blocks = 2 if spec.mamba_cache_mode == "align" else 1
        return min(num_state_blocks, cdiv(max_model_len, spec.block_size))
    num_sequence_blocks = cdiv(max_model_len, spec.block_size)
    if max_num_scheduled_tokens is None:
        return num_sequence_blocks
    match spec:
        case SlidingWindowSpec():
            num_span_blocks = num_window_blocks(spec, max_num_scheduled_tokens)
        case ChunkedLocalAttentionSpec():
            num_span_blocks = num_chunk_blocks(spec, max_num_scheduled_tokens)
        case _:
            # Full attention keeps everything. R-SWA frees only generated tokens between the
            # prompt and its window, so a request whose prompt is max_model_len long keeps all.
            num_span_blocks = num_sequence_blocks
    return min(num_sequence_blocks, num_span_blocks)


def num_window_blocks(spec: SlidingWindowSpec, max_num_scheduled_tokens: int) -> int:
    """Blocks a sliding-window group holds for one request while it is given up to
    `max_num_scheduled_tokens` tokens a step.

    Before a step's allocation the manager frees the blocks wholly before the window of the first
    scheduled token, so the request then spans the `sliding_window - 1` tokens before it and the
    step's own tokens; a span that starts mid-block touches one block more than it fills:

    ```
    | freed (null) | window - 1 | scheduled tokens |
                   |<---- cdiv(., block_size) + 1 ---->|
    ```
    """
    num_tokens = spec.sliding_window - 1 + max_num_scheduled_tokens
    return cdiv(num_tokens, spec.block_size) + 1


def num_chunk_blocks(spec: ChunkedLocalAttentionSpec, max_num_scheduled_tokens: int) -> int:
    """Blocks a chunked-local group holds for one request while it is given up to
    `max_num_scheduled_tokens` tokens a step.

    Before a step's allocation the manager frees the blocks of earlier chunks, so the request
    spans at most `attention_chunk_size - 1` tokens of the first scheduled token's chunk and the
    step's own tokens; chunks start on a block boundary (the manager refuses other sizes):

    ```
    | freed (null) | chunk so far | scheduled tokens |
                   |<---- cdiv(., block_size) ------>|
    ```
    """
    num_tokens = spec.attention_chunk_size - 1 + max_num_scheduled_tokens
    return cdiv(num_tokens, spec.block_size)


def resolve_hash_block_size(kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    """The block size requests hash at: the gcd of the groups' block sizes (`get_hash_block_size`).

    Cross-attention groups are left out: they are never prefix-cached, so their block size need
    not divide into hashes (unless they are the only groups).
    """
    sizes = [
        g.spec.block_size for g in kv_cache_groups if not isinstance(g.spec, CrossAttentionSpec)
    ]
    return get_hash_block_size(sizes or [g.spec.block_size for g in kv_cache_groups])


def plan_kv_cache(
    kv_cache_groups: list[KVCacheGroupSpec],
    num_blocks_per_rank: list[int],
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """One KVCacheConfig for every rank: the fewest blocks any rank holds, or the override.

    Args:
        num_blocks_per_rank: the blocks each rank's KV-cache memory holds, indexed by rank (each
            rank measures its own memory in blocks of the agreed layout).
    """
    if not kv_cache_groups:
        raise ValueError("kv_cache_groups is empty: expected at least one group of layers")
    # Groups may differ in block size: requests hash at the gcd (`hash_block_size`), which
    # every group's block size is a multiple of, and each block id still serves one group.
    if not num_blocks_per_rank or min(num_blocks_per_rank) < 0:
        raise ValueError(
            f"num_blocks_per_rank={num_blocks_per_rank}: expected a count per rank, none negative"
        )
    num_blocks = min(num_blocks_per_rank)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override > num_blocks:
            logger.warning(
                "num_gpu_blocks_override=%d exceeds the %d blocks the smallest rank can hold",
                num_gpu_blocks_override,
                num_blocks,
            )
        num_blocks = num_gpu_blocks_override
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=list(kv_cache_groups))


def describe_capacity(
    kv_cache_config: KVCacheConfig, max_model_len: int, num_blocks_per_request: int
) -> str:
    """ "KV cache holds N tokens; max concurrency X at max_model_len L"

    X is how many requests of `max_model_len` tokens the usable blocks hold at their peak, each
    taking `num_blocks_per_request`; N = X x L tokens (rounded down), as vLLM reports them.
    """
    num_usable_blocks = kv_cache_config.num_blocks - NUM_NULL_BLOCKS
    max_concurrency = num_usable_blocks / num_blocks_per_request
    num_tokens = num_usable_blocks * max_model_len // num_blocks_per_request
    return (
        f"KV cache holds {num_tokens} tokens; "
        f"max concurrency {max_concurrency:.2f} at max_model_len {max_model_len}"
    )
