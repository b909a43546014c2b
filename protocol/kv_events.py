"""KV-cache events for KV-aware routers, encoded byte for byte as vLLM 0.33 encodes its own.

Events are maps tagged `"type"`, with vLLM's fields in vLLM's order and unset optional fields
left out; a batch is an array. Only wire shapes: no sockets, only stdlib and msgspec.
"""

import msgspec

# vLLM's `medium` names: where a block lives. A block moving down a tier is a BlockRemoved on
# one medium and a BlockStored on the next, as vLLM's offloading connector reports it.
MEDIUM_GPU = "GPU"  # the device block pool: the paged cache on the ranks' devices
MEDIUM_CPU = "CPU"  # the host tier (DESIGN.md §3.5): slots in each rank's host memory
MEDIUM_DISK = "DISK"  # the disk tier: slots in one preallocated file per rank


class BlockStored(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Hashes newly in the prefix cache, each block's parent the one before it in the list.

    `lora_id`, `medium` and `lora_name` have no default because vLLM's decoder requires them on
    the wire. The fields after `group_idx` are vLLM's and kvserve never sets them: declared so
    that a frame from vLLM decodes whole and the map header has vLLM's width (map16).
    """

    block_hashes: list[bytes]  # hash of each new block, in prefix order
    parent_block_hash: bytes | None  # hash of the block before the first one; None at token 0
    token_ids: list[int]  # the tokens of all new blocks, concatenated
    block_size: int  # tokens per block
    lora_id: int | None  # LoRA adapter id; None, as kvserve serves no adapters
    medium: str | None  # where the blocks live: MEDIUM_GPU, MEDIUM_CPU or MEDIUM_DISK
    lora_name: str | None  # LoRA adapter name; None, as kvserve serves no adapters
    extra_keys: list[msgspec.Raw] | None = None  # per block, other inputs of its hash
    group_idx: int | None = None  # the KV-cache group the blocks belong to
    kv_cache_spec_kind: str | None = None  # the group's attention kind
    kv_cache_spec_sliding_window: int | None = None  # the group's window, in tokens
    locality: str | None = None  # "LOCAL" or "REMOTE" to the publisher
    ownership: str | None = None  # the offloading tier that stored the blocks
    session_id: str | None = None  # the session whose request stored the blocks
    lookahead_token_ids: list[list[int]] | None = None  # per block, tokens past it in its hash


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """Hashes that left the prefix cache: the last cached copy was evicted."""

    block_hashes: list[bytes]
    medium: str | None  # where the blocks lived: MEDIUM_GPU, MEDIUM_CPU or MEDIUM_DISK
    group_idx: int | None = None  # the KV-cache group the blocks belonged to
    locality: str | None = None  # "LOCAL" or "REMOTE" to the publisher
    ownership: str | None = None  # the offloading tier the blocks left


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """The prefix cache was reset: every hash is gone."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Events published together, with the time they were taken from the engine, in seconds."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None  # the engine's data-parallel rank: 0, the only one


def block_stored(
    block_hashes: list[bytes],
    parent_block_hash: bytes | None,
    token_ids: list[int],
    block_size: int,
    group_idx: int,
    medium: str = MEDIUM_GPU,
) -> BlockStored:
    """A BlockStored as kvserve publishes it: with no LoRA adapter, on the GPU medium unless
    told. A lower tier's stores carry no tokens and no parent, as vLLM's offloading connector
    sends them: a subscriber learns the tokens from the GPU store that came first."""
    return BlockStored(
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        None,
        medium,
        None,
        None,
        group_idx,
    )


def block_removed(
    block_hashes: list[bytes], group_idx: int, medium: str = MEDIUM_GPU
) -> BlockRemoved:
    """A BlockRemoved as kvserve publishes it: on the GPU medium unless told."""
    return BlockRemoved(block_hashes, medium, group_idx=group_idx)
