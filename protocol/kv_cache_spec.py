"""KV-cache layout specs, the per-rank KVCacheConfig the engine sends to every worker, and the
layout arithmetic both sides share: the engine plans with it, the worker allocates from it.

Groups share the KV tensors by layer index, as vLLM lays them out: tensor i holds layer i of every
group, so a block id, held by one group at a time, costs one page in each shared tensor.
"""

import math
from typing import Annotated

import msgspec

DTYPE_SIZES_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "fp8_e4m3": 1,  # float8 e4m3 (the KV cache's --kv-cache-dtype fp8), scale 1
    "int32": 4,
    "int64": 8,
}

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
MAMBA_CACHE_MODES = ("none", "align")  # MambaSpec.mamba_cache_mode
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


class ChunkedLocalAttentionSpec(_AttentionSpec, frozen=True, tag=True):
    """Every layer of the group attends only within its own chunk of `attention_chunk_size` tokens.

    The query at position p reads positions `p // attention_chunk_size * attention_chunk_size`
    through p: earlier chunks are never read again.
    """

    attention_chunk_size: PositiveInt  # tokens per chunk


class RSWASpec(_AttentionSpec, frozen=True, tag=True):
    """Reference sliding-window attention (R-SWA): the prompt stays visible, decode slides.

    The query at position p reads every prompt token and the tokens at positions
    `p - rswa_window` through p; generated tokens between the prompt and that window are never
    read again.
    """

    rswa_window: PositiveInt  # tokens before the current one that stay visible after the prompt


class CrossAttentionSpec(_AttentionSpec, frozen=True, tag=True):
    """Cross-attention of an encoder-decoder model: every decoder token reads the K/V that the
    encoder computed for the request's `encoder_token_ids`, never the decoder's own tokens.

    A request's table holds `cdiv(num_encoder_tokens, block_size)` blocks from admission to its
    end; it never grows with decoder tokens and is never prefix-cached.
    """

    max_num_encoder_tokens: PositiveInt  # the model's longest encoder input, in tokens


class MLAAttentionSpec(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Multi-head latent attention: each token caches one latent vector per layer, from which every
    head's K and V are up-projected at attention time. No K/V split and no heads, so the page is not
    sharded over TP ranks: every rank holds the whole latent. The engine manages it as full
    attention (every layer attends to the whole prefix).
    """

    block_size: PositiveInt  # tokens per block
    latent_dim: PositiveInt  # values per token: the compressed K/V and any shared rotary key part
    dtype: str  # a key of DTYPE_SIZES_BYTES

    def page_size_bytes(self, tp_size: int = 1) -> int:
        """Bytes one block takes in one layer on any rank: the latent of block_size tokens.

        `tp_size` does not divide it (the latent is replicated); it is taken for the shared API.
        """
        return self.block_size * self.latent_dim * dtype_size_bytes(self.dtype)


class MambaSpec(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Recurrent state layers (Mamba-style): each layer keeps one fixed-size state per request,
    not K/V per token. A block holds one state for each layer of the group: the state after the
    request's tokens up to some position (see engine_core/kv_cache/mamba_manager.py).

    `state_shapes` are the whole model's; the first dimension of each (its heads or channels) is
    split over TP ranks, as vLLM shards Mamba heads, so every rank holds its own heads' state.

    Modes (`mamba_cache_mode`), as the reference names them: "none" keeps one state block per
    request, updated in place and never prefix-cached; "align" also keeps, in its own block, the
    state at each block boundary a prefix hit could resume from (every `block_size` tokens).
    """

    block_size: PositiveInt  # tokens a state block stands for: its hash and checkpoint spacing
    state_shapes: tuple[tuple[PositiveInt, ...], ...]  # one layer's state tensors, whole model
    dtype: str  # a key of DTYPE_SIZES_BYTES, for every state tensor
    mamba_cache_mode: str = "none"  # one of MAMBA_CACHE_MODES

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode={self.mamba_cache_mode!r}: expected one of {MAMBA_CACHE_MODES}"
            )
        if not self.state_shapes or not all(self.state_shapes):
            raise ValueError(
                f"state_shapes={self.state_shapes}: expected at least one state tensor, each of "
                f"at least one dimension"
            )

    def page_size_bytes(self, tp_size: int = 1) -> int:
        """Bytes one block takes in one layer on one rank: that rank's share of every state."""
        num_values = 0
        for shape in self.state_shapes:
            if shape[0] % tp_size:
                raise ValueError(
                    f"mamba state shape {shape} is not divisible by tp_size={tp_size} in its "
                    f"first dimension"
                )
            num_values += math.prod(shape) // tp_size
        return num_values * dtype_size_bytes(self.dtype)


KVCacheSpec = (
    FullAttentionSpec
    | SlidingWindowSpec
    | ChunkedLocalAttentionSpec
    | RSWASpec
    | MLAAttentionSpec
    | CrossAttentionSpec
    | MambaSpec
)


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
    # The generation's shared-memory step ring (DESIGN.md §1), None: every step goes over ZMQ.
    # Reader i of the ring is rank shm_ring_reader_ranks[i]; other ranks keep ZMQ.
    shm_ring_name: str | None = None
    shm_ring_reader_ranks: list[int] = []
    # Tiers below the pool (DESIGN.md §3.5): slots of bytes_per_block each that every rank
    # allocates (0: no such tier), and the folder of the disk tier's one file per rank.
    num_host_slots: int = 0
    num_disk_slots: int = 0
    disk_dir: str | None = None
    # A prefill engine's ranks serve pulls of pinned blocks (DESIGN.md §12) at an endpoint under
    # this address: "ipc://FOLDER" (a socket file per rank there) or "tcp://HOST" (a free port);
    # None: the rank serves none
    kv_transfer_address: str | None = None
    # How a P/D engine's ranks move pages (protocol/config.KVTransport); None: the engine takes
    # no part in P/D, so its ranks make no NIXL agent
    kv_transport: str | None = None


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: the number of blocks of `denominator` tokens that hold `numerator`."""
    return -(numerator // -denominator)


def dtype_size_bytes(dtype: str) -> int:
    if dtype not in DTYPE_SIZES_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPE_SIZES_BYTES)}")
    return DTYPE_SIZES_BYTES[dtype]


def num_shared_tensors(kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    """KV tensors per rank: as many as the largest group has layers.

    A group with fewer layers leaves the last tensors' pages of its blocks unused (vLLM pads such
    groups with layers that are never read); tiny-llama-hybrid's groups are equal, so none is lost.
    """
    return max((len(group.layer_names) for group in kv_cache_groups), default=0)


def shared_tensor_layers(kv_cache_groups: list[KVCacheGroupSpec]) -> list[list[str]]:
    """The layers of each shared KV tensor: tensor i holds the i-th layer of every group."""
    layers: list[list[str]] = [[] for _ in range(num_shared_tensors(kv_cache_groups))]
    for group in kv_cache_groups:
        for layer_idx, name in enumerate(group.layer_names):
            layers[layer_idx].append(name)
    return layers


def page_stride_bytes(kv_cache_groups: list[KVCacheGroupSpec], tp_size: int) -> int:
    """Bytes from one block to the next in a shared tensor: the largest page of any group.

    Groups of one page size share tensors exactly as vLLM does. Where page sizes differ (vLLM
    would refuse or reshape the groups instead), each smaller page is padded to the largest so
    that every group can still view the same tensor; the stride is rounded up to a multiple of
    the widest dtype so that every group's elements stay aligned.
    """
    if not kv_cache_groups:
        raise ValueError("kv_cache_groups is empty: expected at least one group of layers")
    largest_page = max(group.spec.page_size_bytes(tp_size) for group in kv_cache_groups)
    alignment = max(dtype_size_bytes(group.spec.dtype) for group in kv_cache_groups)
    return cdiv(largest_page, alignment) * alignment


def bytes_per_block(kv_cache_groups: list[KVCacheGroupSpec], tp_size: int) -> int:
    """Bytes one block id costs on one rank: one page in each shared tensor.

    A block belongs to one group at a time, so it costs a page per layer of one group (the
    largest), not a page per layer of every group.
    """
    return num_shared_tensors(kv_cache_groups) * page_stride_bytes(kv_cache_groups, tp_size)
