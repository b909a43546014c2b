"""BlockHashToBlockMap: the prefix-cache index from a key (hash with group id) to its blocks.

Owned and updated by BlockPool only. It files and finds blocks, and changes one only to clear
the key of a block it unfiles.
"""

from collections.abc import Iterable

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.hashing import BlockHashWithGroupId


class BlockHashToBlockMap:
    """Prefix-cache keys to the blocks that carry them.

    A key maps to one block, or to several when the same content was computed twice (blocks are
    never deduplicated: block tables only grow). Lookups return the copy inserted earliest among
    those still cached. `_first` holds that copy for every key, so a lookup is one dict probe;
    `_copies` holds `{block_id: block}`, in insertion order, only for keys with two or more.

    Invariants: `_copies` keys are a subset of `_first` keys; a `_copies` entry holds at least two
    blocks and its first value is the `_first` block; every block filed carries the key.
    """

    __slots__ = ("_copies", "_first", "file_first", "get_one_block")

    def __init__(self) -> None:
        self._first: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self._copies: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # The earliest cached copy of a key, or None: the dict's own `get`, so that the hottest
        # call in the pool runs no Python frame.
        self.get_one_block = self._first.get
        # Files `block` as the copy lookups find unless one is filed: returns the copy they find.
        # A caller given another block passes both to `add_copy`. The dict's own `setdefault`.
        self.file_first = self._first.setdefault

    def get_block(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """The copy of `key` held by block `block_id`, if that block is cached under it."""
        copies = self._copies.get(key)
        if copies is not None:
            return copies.get(block_id)
        block = self._first.get(key)
        return block if block is not None and block.block_id == block_id else None

    def add_copy(self, key: BlockHashWithGroupId, first: KVCacheBlock, block: KVCacheBlock) -> None:
        """File `block` beside `first`, the copy `file_first` found under `key`."""
        copies = self._copies.get(key)
        if copies is None:
            self._copies[key] = {first.block_id: first, block.block_id: block}
        else:
            copies[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove exactly block `block_id` from `key`; the other copies stay cached."""
        first = self._first.get(key)
        if first is None:
            return None
        copies = self._copies.get(key)
        if copies is None:
            if first.block_id != block_id:
                return None
            del self._first[key]
            return first
        block = copies.pop(block_id, None)
        if block is first:  # the next copy in insertion order becomes the one lookups find
            self._first[key] = next(iter(copies.values()))
        if len(copies) == 1:
            del self._copies[key]
        return block

    def unfile_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Remove each block from the key it carries, then clear that key from the block: what
        `pop` and `block.block_hash = None` do, for many blocks in one pass."""
        first, copies = self._first, self._copies
        for block in blocks:
            key = block.block_hash
            block.block_hash = None
            if copies and key in copies:
                self.pop(key, block.block_id)
                continue
            # One probe of a large dict, not a lookup then a delete: this is memory-bound.
            filed = first.pop(key, None)
            if filed is not block and filed is not None:
                first[key] = filed  # another block's key: leave it filed

    def clear(self) -> None:
        self._first.clear()
        self._copies.clear()

    def num_blocks(self) -> int:
        """Cached blocks, counting every copy (a walk; not for the hot path)."""
        num_extra = sum(len(copies) - 1 for copies in self._copies.values())
        return len(self._first) + num_extra

    def __len__(self) -> int:
        return len(self._first)

    def check_invariants(self) -> None:
        first = self._first
        for key, copies in self._copies.items():
            assert len(copies) >= 2, f"key {key.hex()} holds copies of {len(copies)} blocks"
            head = next(iter(copies.values()))
            assert first.get(key) is head, (
                f"key {key.hex()} finds {first.get(key)!r}, its earliest copy is {head!r}"
            )
        for key, head in first.items():
            for block_id, block in self._copies.get(key, {head.block_id: head}).items():
                assert block.block_id == block_id and block.block_hash == key, (
                    f"key {key.hex()} maps id {block_id} to {block!r}"
                )
