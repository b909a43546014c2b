"""Which KV layouts can move between engines in disaggregated prefill and decode (DESIGN.md §12)."""

import importlib.util

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig


def nixl_available() -> bool:
    """Whether NIXL is installed here (the `nixl` extra), without importing it."""
    return importlib.util.find_spec("nixl") is not None


def describe_unsupported_layout(kv_cache_config: KVCacheConfig) -> str | None:
    """Why this model's KV cannot move yet, or None when it can: one full-attention group, whose
    blocks hold nothing but the K/V of their own tokens."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"the model has {len(groups)} KV-cache groups: P/D moves one-group models only"
    if not isinstance(groups[0].spec, FullAttentionSpec):
        kind = type(groups[0].spec).__name__
        return f"the model's KV-cache group is {kind}: P/D moves full attention only"
    return None
