"""BlockHashToBlockMap: the prefix-cache index from a key (hash with group id) to its blocks.

Owned and updated by BlockPool only; it never changes a block, it only files and finds them.
"""

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.hashing import BlockHashWithGroupId


class BlockHashToBlockMap:
    """Prefix-cache keys to the blocks that carry them.

    A key maps to one block, or to `{block_id: block}` when the same content was computed twice
    (blocks are never deduplicated: block tables only grow). Lookups return the copy inserted
    earliest among those still cached.

    Invariants: a dict entry holds at least two blocks; every block in an entry carries the key.
    """

    __slots__ = ("_cache", "_get_entry")

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._get_entry = self._cache.get  # bound once: lookups are the hottest path

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        entry = self._get_entry(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        return next(iter(entry.values()))

    def get_block(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """The copy of `key` held by block `block_id`, if that block is cached under it."""
        entry = self._cache.get(key)
        if entry is None or type(entry) is KVCacheBlock:
            return entry if entry is not None and entry.block_id == block_id else None
        return entry.get(block_id)

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        cache = self._cache
        entry = cache.get(key)
        if entry is None:
            cache[key] = block
        elif type(entry) is KVCacheBlock:
            cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove exactly block `block_id` from `key`; the other copies stay cached."""
        cache = self._cache
        entry = cache.get(key)
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            if entry.block_id != block_id:
                return None
            del cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            cache[key] = next(iter(entry.values()))
        return block

    def clear(self) -> None:
        self._cache.clear()

    def num_blocks(self) -> int:
        """Cached blocks, counting every copy (a walk; not for the hot path)."""
        return sum(1 if type(e) is KVCacheBlock else len(e) for e in self._cache.values())

    def __len__(self) -> int:
        return len(self._cache)

    def check_invariants(self) -> None:
        for key, entry in self._cache.items():
            if type(entry) is KVCacheBlock:
                entry = {entry.block_id: entry}
            else:
                assert len(entry) >= 2, f"key {key.hex()} holds a dict of {len(entry)} blocks"
            for block_id, block in entry.items():
                assert block.block_id == block_id and block.block_hash == key, (
                    f"key {key.hex()} maps id {block_id} to {block!r}"
                )
