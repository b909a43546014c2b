"""A checkpoint's KV-cache layout and ModelInfo: layers grouped by spec (full attention, and
sliding-window groups per window size), with the layer names the decoder writes and reads under.

Groups are of one size where kinds mix, as vLLM lays hybrid models out: layer i of every group
views one shared tensor (worker/kv_cache.py), so a block id costs a page in as many layers as the
largest group has. A Gemma 3 of 4 full and 22 sliding layers in two groups would pay 22 pages for
every full-attention block; in groups of 4 (one full, six sliding, the last of two layers) it
pays 4, and its window groups hold only their windows' blocks. `python -m bench.capacity` shows
the gain over every layer reading the whole context.
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
    """Full-attention groups first (when any), then sliding-window groups by window; where kinds
    mix, each kind's layers (in order) split into groups of the fewest layers any kind has."""
    dims = dict(
        block_size=block_size,
        num_kv_heads=cached_kv_heads(config, tp_size),
        head_dim=config.head_dim,
        dtype=kv_dtype,
    )
    windows = config.sliding_windows
    kinds = []  # (layers, spec) of each kind
    full = [layer_name(i) for i, window in enumerate(windows) if window is None]
    if full:
        kinds.append((full, FullAttentionSpec(**dims)))
    for window in sorted({w for w in windows if w is not None}):
        layers = [layer_name(i) for i, w in enumerate(windows) if w == window]
        kinds.append((layers, SlidingWindowSpec(**dims, sliding_window=window)))
    size = min(len(layers) for layers, _ in kinds)
    return [
        KVCacheGroupSpec(layers[start : start + size], spec)
        for layers, spec in kinds
        for start in range(0, len(layers), size)
    ]


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
