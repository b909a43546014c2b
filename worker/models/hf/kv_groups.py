"""A checkpoint's KV-cache layout and ModelInfo: layers grouped by spec (full attention, and a
sliding-window group per window size), with the layer names the decoder writes and reads under.
"""

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from protocol.worker_messages import ModelInfo
from worker.models.hf.config import HFConfig


def layer_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn"


def cached_kv_heads(config: HFConfig, tp_size: int) -> int:
    """KV heads the cache holds over all ranks: the model's, or tp_size where TP replicates
    them (each rank then caches one)."""
    return max(config.num_kv_heads, tp_size)


def kv_cache_groups(
    config: HFConfig, block_size: int, kv_dtype: str, tp_size: int
) -> list[KVCacheGroupSpec]:
    """Full-attention layers first (when any), then one sliding-window group per window."""
    dims = dict(
        block_size=block_size,
        num_kv_heads=cached_kv_heads(config, tp_size),
        head_dim=config.head_dim,
        dtype=kv_dtype,
    )
    windows = config.sliding_windows
    full = [layer_name(i) for i, window in enumerate(windows) if window is None]
    groups = [KVCacheGroupSpec(full, FullAttentionSpec(**dims))] if full else []
    for window in sorted({w for w in windows if w is not None}):
        layers = [layer_name(i) for i, w in enumerate(windows) if w == window]
        groups.append(KVCacheGroupSpec(layers, SlidingWindowSpec(**dims, sliding_window=window)))
    return groups


def hf_model_info(config: HFConfig, block_size: int, kv_dtype: str, tp_size: int) -> ModelInfo:
    """What the engine plans with; max_model_len is max_position_embeddings (the engine's
    --max-model-len may lower it)."""
    return ModelInfo(
        name=config.path,
        vocab_size=config.vocab_size,
        eos_token_ids=list(config.eos_token_ids),
        max_model_len=config.max_position_embeddings,
        kv_cache_groups=kv_cache_groups(config, block_size, kv_dtype, tp_size),
    )
