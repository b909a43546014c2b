"""TierHit and TierHitView: prefix hits that live below the pool, as the managers' scans see them.

A scan asks the view where the pool would answer; where the pool misses and a lower tier holds
the key, the view answers a TierHit stand-in. So every kind of hit search (full attention's
prefix, a window's run, the hybrid fixed point) counts tier hits by its own rules. A TierHit is
never touched, tabled or freed: admission replaces it by a fresh device block.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    group_id_suffix,
)
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.tier_index import TierIndex

NO_BLOCK_ID = -1  # a TierHit has no device block until admission gives it one


class HitSource(Protocol):
    """The lookups a hit scan reads: the BlockPool's own, or a TierHitView's past them."""

    null_block: KVCacheBlock

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None: ...

    def get_cached_prefix(
        self, block_hashes: Sequence[BlockHash], num_blocks: int, kv_cache_group_id: int
    ) -> list[KVCacheBlock]: ...


@dataclass(slots=True, eq=False)
class TierHit(KVCacheBlock):
    """A hit in the host tier (`tier_slot` is its host slot) or on disk (`is_on_disk`).

    Its `ref_cnt` stays 0 and it is not null, so capacity counts it as one free block consumed,
    which is what its fresh device block costs.
    """

    tier_slot: int = 0  # the host slot, or the disk slot when on disk
    is_on_disk: bool = False


class TierHitView:
    """The pool's lookups (`get_cached_block`, `get_cached_prefix`, `null_block`), extended
    into the host tier and, with `include_disk`, the disk tier. Touches nothing."""

    def __init__(
        self, pool: BlockPool, host: TierIndex, disk: TierIndex | None, include_disk: bool
    ) -> None:
        self.pool = pool
        self.null_block = pool.null_block
        self.enable_caching = pool.enable_caching
        self.host = host
        self.disk = disk if include_disk else None
        self._suffixes: dict[int, bytes] = {}
        self._get_one_block = pool.cached_block_hash_to_block.get_one_block  # bound once

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One block per group, the pool's where it has one, else a TierHit; None on a miss."""
        blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = self._find(block_hash + self._suffix(group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def get_cached_prefix(
        self, block_hashes: Sequence[BlockHash], num_blocks: int, kv_cache_group_id: int
    ) -> list[KVCacheBlock]:
        """The longest run from block 0 that the pool or a tier holds."""
        # The pool's own scan first (most hits end there), then block by block past its miss.
        hits = self.pool.get_cached_prefix(block_hashes, num_blocks, kv_cache_group_id)
        if len(hits) == num_blocks:
            return hits
        suffix = self._suffix(kv_cache_group_id)
        for idx in range(len(hits), num_blocks):
            block = self._find(block_hashes[idx] + suffix)
            if block is None:
                break
            hits.append(block)
        return hits

    def _find(self, key: bytes) -> KVCacheBlock | None:
        block = self._get_one_block(key)
        if block is not None:
            return block
        tier_key = BlockHashWithGroupId(key)
        host = self.host
        slot = host.slot_of(tier_key)
        if slot is not None and slot not in host.pending:
            return TierHit(NO_BLOCK_ID, block_hash=tier_key, tier_slot=slot)
        disk = self.disk
        if disk is None:
            return None
        if slot is not None:  # on its way up for another request: wait for it as a disk hit
            return TierHit(NO_BLOCK_ID, block_hash=tier_key, tier_slot=slot, is_on_disk=True)
        disk_slot = disk.slot_of(tier_key)
        if disk_slot is None or disk_slot in disk.pending:
            return None
        return TierHit(NO_BLOCK_ID, block_hash=tier_key, tier_slot=disk_slot, is_on_disk=True)

    def _suffix(self, group_id: int) -> bytes:
        suffix = self._suffixes.get(group_id)
        if suffix is None:
            suffix = self._suffixes[group_id] = group_id_suffix(group_id)
        return suffix


def replace_tier_hits(
    pool: BlockPool,
    request: KVCacheRequest,
    computed: tuple[Sequence[KVCacheBlock], ...],
    block_sizes: Sequence[int],
    hash_block_size: int,
    copy_in: Callable[[int, int], None],
) -> tuple[Sequence[KVCacheBlock], ...]:
    """Admit a lookup with host hits: touch its pool hits first (so that nothing below can evict
    them), give each TierHit a fresh device block cached under its key, and `copy_in(host slot,
    block id)` in this step. The caller saves the tables without touching them again.

    Args:
        block_sizes: tokens per block of each KV-cache group, by group id.
        hash_block_size: the block size requests hash at (a group reads every
            `block_size // hash_block_size`-th hash).
    """
    num_tier_hits = 0
    for blocks in computed:
        pool.touch([block for block in blocks if not isinstance(block, TierHit)])
        num_tier_hits += sum(1 for block in blocks if isinstance(block, TierHit))
    # In table order; this may evict pool blocks, whose copies cannot take the pinned slots.
    fresh = iter(pool.get_new_blocks(num_tier_hits))
    tables: list[Sequence[KVCacheBlock]] = []
    for group_id, blocks in enumerate(computed):
        table = list(blocks)
        block_size = block_sizes[group_id]
        scale = block_size // hash_block_size  # the group reads every scale-th hash
        for idx, hit in enumerate(blocks):
            if not isinstance(hit, TierHit):
                continue
            assert not hit.is_on_disk and hit.block_hash is not None, f"{hit!r} is not read"
            block = next(fresh)
            # Cached as the pool caches a full block: announced with its tokens and its
            # parent, the hash before it in the group.
            tokens = request.all_token_ids[idx * block_size : (idx + 1) * block_size]
            parent = bytes(request.block_hashes[idx * scale - 1]) if idx else None
            pool.cache_loaded_block(block, hit.block_hash, list(tokens), parent, block_size)
            copy_in(hit.tier_slot, block.block_id)
            table[idx] = block
        tables.append(table)
    return tuple(tables)
