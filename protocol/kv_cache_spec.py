"""KV-cache layout specs and the per-rank KVCacheConfig that the engine sends to every worker.

They live in protocol/ because both sides need them: the engine plans with them and the worker
allocates from them. The planning logic is in engine_core/kv_cache/spec.py.
"""

from typing import Annotated

import msgspec

DTYPE_SIZES_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int32": 4,
    "int64": 8,
}

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NULL_BLOCK_ID = 0  # the placeholder for skipped positions: never hashed, never holds live K/V


class _AttentionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fields shared by every attention spec; never sent on its own."""

    block_size: PositiveInt  # tokens per block
    num_kv_heads: PositiveInt  # KV heads of the whole model, before sharding over TP ranks
    head_dim: PositiveInt
    dtype: str  # a key of DTYPE_SIZES_BYTES

    def page_size_bytes(self, tp_size: int = 1) -> int:
        """Bytes one block takes in one layer on one rank: K and V of block_size tokens."""
        return (
            2
            * self.block_size
            * self.num_kv_heads_per_rank(tp_size)
            * self.head_dim
            * dtype_size_bytes(self.dtype)
        )

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        if self.num_kv_heads % tp_size:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} is not divisible by tp_size={tp_size}"
            )
        return self.num_kv_heads // tp_size


class FullAttentionSpec(_AttentionSpec, frozen=True, tag=True):
    """Every layer of the group attends to the whole prefix."""


class SlidingWindowSpec(_AttentionSpec, frozen=True, tag=True):
    """Every layer of the group attends only to the last `sliding_window` tokens."""

    sliding_window: PositiveInt  # tokens, the current one included


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


class KVCacheGroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Layers that share one block table because they share one spec."""

    layer_names: list[str]
    spec: KVCacheSpec


class KVCacheConfig(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The agreed cache layout: the same num_blocks for every group and every rank."""

    num_blocks: PositiveInt  # blocks in the one shared pool, the null block 0 included
    kv_cache_groups: list[KVCacheGroupSpec]
    check_invariants: bool = False  # workers walk their ModelRunner and BlockTables after each step
    # The worker generation this config admits (DESIGN.md §8): 1 at startup, one more after each
    # rank fault. Every later message between the engine and the rank carries it.
    generation: int = 1
    first_step_id: int = 1  # the generation's first SchedulerOutput; step ids never restart


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: the number of blocks of `denominator` tokens that hold `numerator`."""
    return -(numerator // -denominator)


def dtype_size_bytes(dtype: str) -> int:
    if dtype not in DTYPE_SIZES_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPE_SIZES_BYTES)}")
    return DTYPE_SIZES_BYTES[dtype]


def bytes_per_block(kv_cache_groups: list[KVCacheGroupSpec], tp_size: int) -> int:
    """Bytes one block id costs on one rank: every layer of every group holds a page for it."""
    return sum(
        len(group.layer_names) * group.spec.page_size_bytes(tp_size) for group in kv_cache_groups
    )
