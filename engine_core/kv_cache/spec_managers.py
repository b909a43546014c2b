"""Which SingleTypeKVCacheManager serves a KV-cache spec: one place that knows every kind.

The managers live in their own modules and import the base class; this registry imports them all,
so nothing needs a late import to avoid a cycle.
"""

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.cross_attention_manager import CrossAttentionManager
from engine_core.kv_cache.local_attention_managers import ChunkedLocalAttentionManager, RSWAManager
from engine_core.kv_cache.mamba_manager import MambaManager
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SlidingWindowSpec,
)


def make_single_type_manager(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """The manager class for the spec's attention kind."""
    manager_cls = spec_manager_class(kv_cache_spec)
    return manager_cls(kv_cache_spec, block_pool, kv_cache_group_id)


def spec_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    match kv_cache_spec:
        case SlidingWindowSpec():
            return SlidingWindowManager
        case RSWASpec():
            return RSWAManager
        case ChunkedLocalAttentionSpec():
            return ChunkedLocalAttentionManager
        case FullAttentionSpec() | MLAAttentionSpec():
            return FullAttentionManager  # an MLA layer attends to the whole prefix of latents
        case CrossAttentionSpec():
            return CrossAttentionManager
        case MambaSpec():
            return MambaManager
    raise TypeError(f"no KV-cache manager for spec {kv_cache_spec!r}")
