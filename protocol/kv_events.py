"""KV-cache events for KV-aware routers: BlockStored, BlockRemoved and AllBlocksCleared."""

import msgspec


class BlockStored(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Blocks newly hashed into the prefix cache by one `cache_full_blocks` call."""

    block_hashes: list[bytes]  # hash bytes of each new block, in prefix order
    parent_block_hash: bytes | None  # hash of the block before the first one; None at token 0
    token_ids: list[int]  # the tokens of all new blocks, concatenated
    block_size: int
    group_idx: int  # the KV-cache group the blocks belong to


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Hashes that left the prefix cache (eviction on reuse, or `evict_blocks`)."""

    block_hashes: list[bytes]
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    """Events published together, with the time they were taken from the engine, in seconds."""

    ts: float
    events: list[KVCacheEvent]
