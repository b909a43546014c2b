"""Which KV layouts can move between engines in disaggregated prefill and decode (DESIGN.md §12)."""

import importlib.util

from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import describe_unsupported_groups


def nixl_available() -> bool:
    """Whether NIXL is installed here (the `nixl` extra), without importing it."""
    return importlib.util.find_spec("nixl") is not None


def describe_unsupported_layout(kv_cache_config: KVCacheConfig) -> str | None:
    """Why this model's KV cannot move yet, or None when it can (protocol/kv_transfer.py)."""
    return describe_unsupported_groups(kv_cache_config.kv_cache_groups)
