"""BlockPool: the one owner of every KV-cache block, the free queue and the prefix-cache map.

Plain bookkeeping, no I/O: it hands blocks out, ref-counts them, keeps freed blocks in reuse
order (cached ones as LRU eviction candidates) and, when asked, records KV events for routers.
Invariants are checked only in `check_invariants()`, never on the hot path.
"""

import gc
import logging
from collections.abc import Callable, Iterable, Sequence

from engine_core.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine_core.kv_cache.block_hash_map import BlockHashToBlockMap
from engine_core.kv_cache.block_metrics import BlockMetricsHook
from engine_core.kv_cache.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    group_id_suffix,
)
from engine_core.kv_cache.kv_request import KVCacheRequest
from protocol.kv_cache_spec import NULL_BLOCK_ID
from protocol.kv_events import AllBlocksCleared, KVCacheEvent, block_removed, block_stored

logger = logging.getLogger(__name__)

__all__ = ["BlockHashToBlockMap", "BlockPool"]


class _GroupIdSuffixes(dict[int, bytes]):
    """group_id -> its 4 big-endian key bytes, made once per group, not once per lookup."""

    def __missing__(self, group_id: int) -> bytes:
        suffix = self[group_id] = group_id_suffix(group_id)
        return suffix


def _check_cacheable(
    request: KVCacheRequest, num_blocks: int, start: int, end: int, mask: Sequence[bool] | None
) -> None:
    """Refuse to cache blocks `[start, end)` past the hashes or blocks held, or a wrong mask."""
    num_hashes = len(request.block_hashes)
    if end > num_hashes or end > num_blocks:
        raise ValueError(
            f"cannot cache {end} full blocks of request {request.req_id}: "
            f"it has {num_hashes} block hashes and {num_blocks} blocks"
        )
    if mask is not None and len(mask) != end - start:
        raise ValueError(
            f"block_mask of {len(mask)} entries for blocks {start} to {end} of request "
            f"{request.req_id}: expected one per block"
        )


def _make_blocks(num_blocks: int) -> list[KVCacheBlock]:
    """Every block, indexed by id, built with the cyclic collector paused.

    None of these objects is garbage, yet a million new ones would start full collections over
    and over, each walking every block made so far: pausing it cuts construction about threefold.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return [KVCacheBlock(idx) for idx in range(num_blocks)]
    finally:
        if was_enabled:
            gc.enable()


class BlockPool:
    """Hands out, ref-counts, caches and recycles the KV-cache blocks (DESIGN.md §3.3).

    Invariants:
    1. A block is free (ref_cnt 0, in the free queue exactly once) or in use (ref_cnt > 0, not
       in the queue). The null block (id 0) is neither, and is never hashed.
    2. `num_free_blocks` is the length of the queue walk; no ref_cnt is negative.
    3. Every map entry points to a block that carries exactly that key, and every hashed block
       is in the map under its key.
    4. A hash is set once, when its block is full; it is cleared only by eviction on reuse,
       `evict_blocks`, or `reset_prefix_cache`.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsHook | None = None,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(
                f"num_gpu_blocks must be at least 1 (the null block), got {num_gpu_blocks}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        self.blocks: list[KVCacheBlock] = _make_blocks(num_gpu_blocks)
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 stands for skipped (out-of-window) positions; it leaves the queue for good.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        self._group_id_suffixes = _GroupIdSuffixes()
        self._get_one_block = self.cached_block_hash_to_block.get_one_block
        # Told (block id, key) when a cached block is reused, before the page is overwritten:
        # the tiers below the pool copy it down in the step that reuses it (DESIGN.md §3.5).
        self.eviction_listener: Callable[[int, BlockHashWithGroupId], None] | None = None

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group, in the order of `kv_cache_group_ids`; None if any misses."""
        if not self.enable_caching:
            return None
        get_one_block, suffixes = self._get_one_block, self._group_id_suffixes
        if len(kv_cache_group_ids) == 1:  # the common case, without the loop
            block = get_one_block(block_hash + suffixes[kv_cache_group_ids[0]])
            return None if block is None else [block]
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            block = get_one_block(block_hash + suffixes[group_id])
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def get_cached_prefix(
        self, block_hashes: Sequence[BlockHash], num_blocks: int, kv_cache_group_id: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest run of `block_hashes[:num_blocks]` from block 0.

        One group's left-to-right scan, with the key suffix looked up once: the common case of a
        full-attention hit, so it skips the per-block list that `get_cached_block` builds.
        """
        if not self.enable_caching:
            return []
        suffix = self._group_id_suffixes[kv_cache_group_id]
        get_one_block = self._get_one_block
        hits: list[KVCacheBlock] = []
        for idx in range(num_blocks):
            block = get_one_block(block_hashes[idx] + suffix)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(
        self,
        request: KVCacheRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Hash `blocks[num_cached_blocks:num_full_blocks]` and cache them; skip null blocks.

        `request.block_hashes[i]` is the hash of block i. `block_mask`, aligned with that range,
        skips (like a null block: no hash, no BlockStored) the blocks no hit can ever use.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        block_hashes = request.block_hashes
        _check_cacheable(request, len(blocks), num_cached_blocks, num_full_blocks, block_mask)
        suffix = self._group_id_suffixes[kv_cache_group_id]
        index = self.cached_block_hash_to_block
        file_first = index.file_first
        is_recording = self.enable_kv_cache_events
        announced: list[int] = []  # indices whose hash had no cached copy: routers learn these
        for idx in range(num_cached_blocks, num_full_blocks):
            block = blocks[idx]
            if block.block_hash is not None:
                self._unfile(blocks[num_cached_blocks:idx], block_mask)
                raise ValueError(
                    f"cannot cache block {block.block_id} at index {idx} of request "
                    f"{request.req_id}: it already has a hash"
                )
            if block.is_null or (
                block_mask is not None and not block_mask[idx - num_cached_blocks]
            ):
                continue
            key = block_hashes[idx] + suffix
            block.block_hash = key
            # Filed one by one, so that a later block of the same content sees this copy.
            first = file_first(key, block)
            if first is not block:
                index.add_copy(key, first, block)
            elif is_recording:
                announced.append(idx)
        if announced:
            self._record_block_stored(request, announced, block_size, kv_cache_group_id)

    def cache_loaded_block(
        self,
        block: KVCacheBlock,
        key: BlockHashWithGroupId,
        token_ids: list[int],
        parent_block_hash: bytes | None,
        block_size: int,
    ) -> None:
        """Cache a fresh block under `key`: its page comes in from a tier below the pool in the
        step that allocated it (DESIGN.md §3.5), so it is full from that step on."""
        if block.block_hash is not None or block.is_null:
            raise ValueError(f"cannot cache loaded block {block.block_id}: {block!r}")
        block.block_hash = key
        index = self.cached_block_hash_to_block
        first = index.file_first(key, block)
        if first is not block:
            index.add_copy(key, first, block)
        elif self.enable_kv_cache_events:
            self.kv_event_queue.append(
                block_stored(
                    [bytes(get_block_hash(key))],
                    parent_block_hash,
                    token_ids,
                    block_size,
                    get_group_id(key),
                )
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, drop their stale hashes, ref them."""
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks < 0 or num_blocks > num_free:
            raise ValueError(f"cannot get {num_blocks} new blocks: {num_free} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        # A reused block may still carry the hash of its old content: drop it, or a later
        # lookup would hit a block that now holds other tokens.
        listener = self.eviction_listener
        if self.enable_kv_cache_events or self.metrics_collector is not None or listener:
            for block in blocks:
                key = block.block_hash
                if key is not None:
                    self._evict_cached_block(block)
                    if listener is not None:
                        listener(block.block_id, key)
                block.ref_cnt = 1
        else:  # nobody to tell: unmap the stale hashes in one call
            stale: list[KVCacheBlock] = []
            for block in blocks:
                if block.block_hash is not None:
                    stale.append(block)
                block.ref_cnt = 1
            if stale:
                self.cached_block_hash_to_block.unfile_blocks(stale)
        collector = self.metrics_collector
        if collector is not None:
            for block in blocks:
                collector.on_block_allocated(block)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on each hit block, pulling free ones off the free queue first."""
        evictable: list[KVCacheBlock] = []  # free hits, unlinked from the queue in one call
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt:
                block.ref_cnt = ref_cnt + 1
            elif not block.is_null:  # the null block is never ref-counted
                evictable.append(block)
                block.ref_cnt = 1
        if evictable:
            self.free_block_queue.remove_n(evictable)
        collector = self.metrics_collector
        if collector is not None:
            for block in blocks:
                if not block.is_null:
                    collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; pass a request's blocks tail first.

        Blocks that reach zero are queued once: unhashed ones at the head as one run (the
        request's last block is reused first), hashed ones at the LRU tail (a prefix's tail is
        evicted before its head). Freeing more often than referenced raises and changes nothing.
        """
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        to_head: list[KVCacheBlock] = []
        to_tail: list[KVCacheBlock] = []
        for idx, block in enumerate(blocks):
            ref_cnt = block.ref_cnt
            if ref_cnt > 1:
                block.ref_cnt = ref_cnt - 1
            elif ref_cnt == 1:
                block.ref_cnt = 0
                if block.block_hash is None:
                    to_head.append(block)
                else:
                    to_tail.append(block)
            elif not block.is_null:
                self._restore_refs(blocks[:idx])
                raise ValueError(
                    f"cannot free block {block.block_id}: it is freed more often than it is "
                    f"referenced (ref_cnt {ref_cnt})"
                )
        if to_head:
            self.free_block_queue.prepend_n(to_head)
        if to_tail:
            self.free_block_queue.append_n(to_tail)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of these blocks (KV reported invalid); they keep their queue place."""
        ids = list(block_ids)
        num_gpu_blocks = self.num_gpu_blocks
        for block_id in ids:
            if not 0 <= block_id < num_gpu_blocks:
                raise ValueError(
                    f"cannot evict block {block_id}: block ids are in [0, {num_gpu_blocks})"
                )
        for block_id in ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict_cached_block(block)

    def reset_refusal_reason(self) -> str | None:
        """Why `reset_prefix_cache` would refuse now, or None if it would succeed."""
        num_used = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used:
            return f"{num_used} blocks are still held by requests, expected 0"
        return None

    def reset_prefix_cache(self) -> bool:
        """Clear every hash when no request holds a block; the free order is kept."""
        reason = self.reset_refusal_reason()
        if reason is not None:
            logger.warning("cannot reset the prefix cache: %s", reason)
            return False
        collector = self.metrics_collector
        for block in self.blocks:
            if block.block_hash is not None:
                block.block_hash = None
                if collector is not None:
                    collector.on_block_evicted(block)
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        logger.info("prefix cache reset")
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """The fraction of usable blocks (the null block excluded) held by requests."""
        capacity = self.num_gpu_blocks - 1
        if capacity == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / capacity

    def cached_block_counts(self) -> dict[str, int]:
        """Hex key (hash then group id) of each hash in the prefix-cache map -> copies cached.

        What a KV-event subscriber that applied every event must hold, keyed as
        `block_hash_with_group_id`: the engine's get_cached_block_hashes call answers with it.
        """
        counts: dict[str, int] = {}
        for block in self.blocks:
            if block.block_hash is not None:
                key = block.block_hash.hex()
                counts[key] = counts.get(key, 0) + 1
        return counts

    def record_event(self, event: KVCacheEvent) -> None:
        """Queue an event of the tiers below the pool, in order with the pool's own."""
        self.kv_event_queue.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call, oldest first."""
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events

    def check_invariants(self) -> None:
        """Walk every block, the queue and the map; raise AssertionError naming what is wrong."""
        self.free_block_queue.check_invariants()
        self.cached_block_hash_to_block.check_invariants()
        null = self.null_block
        assert null is self.blocks[NULL_BLOCK_ID] and null.is_null, "block 0 is not the null block"
        assert null.ref_cnt == 0 and null.block_hash is None, f"null block was used: {null!r}"
        assert null.prev_free_block is None and null.next_free_block is None, (
            "the null block is in the free queue"
        )
        get_block = self.cached_block_hash_to_block.get_block
        num_hashed = num_free = 0
        for idx in range(1, self.num_gpu_blocks):
            block = self.blocks[idx]
            assert block.block_id == idx and not block.is_null, f"blocks[{idx}] is {block!r}"
            assert block.ref_cnt >= 0, f"block {idx} has negative ref_cnt {block.ref_cnt}"
            is_queued = block.prev_free_block is not None
            num_free += block.ref_cnt == 0
            assert is_queued == (block.ref_cnt == 0), (
                f"block {idx} has ref_cnt {block.ref_cnt} but is_queued={is_queued}"
            )
            if block.block_hash is not None:
                num_hashed += 1
                assert get_block(block.block_hash, idx) is block, (
                    f"block {idx} carries {block.block_hash.hex()} but the map does not hold it"
                )
        num_queued = self.free_block_queue.num_free_blocks
        assert num_free == num_queued, f"{num_free} blocks have ref_cnt 0, {num_queued} are queued"
        num_mapped = self.cached_block_hash_to_block.num_blocks()
        assert num_mapped == num_hashed, f"map holds {num_mapped} blocks, {num_hashed} are hashed"
        assert self.enable_caching or num_hashed == 0, "a block is hashed with caching off"

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        self.cached_block_hash_to_block.pop(key, block.block_id)
        block.block_hash = None
        # Announced once for all its copies, a hash is removed only with its last copy.
        if self.enable_kv_cache_events and self._get_one_block(key) is None:
            self.kv_event_queue.append(block_removed([get_block_hash(key)], get_group_id(key)))
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)

    def _unfile(self, filed: Sequence[KVCacheBlock], block_mask: Sequence[bool] | None) -> None:
        """Undo a `cache_full_blocks` call that met an already hashed block after filing `filed`.

        `filed` is the part of the range that the call walked before it stopped, and
        `block_mask` is aligned with it, as in `cache_full_blocks`. The call skipped null blocks
        and masked-off blocks, so those carry no key of its making and stay as they are; every
        other block was given its key and filed, and loses both again. A refused call so leaves
        the prefix-cache map as it found it.
        """
        filed_by_call = [
            block
            for idx, block in enumerate(filed)
            if not block.is_null and (block_mask is None or block_mask[idx])
        ]
        self.cached_block_hash_to_block.unfile_blocks(filed_by_call)

    @staticmethod
    def _restore_refs(blocks: Sequence[KVCacheBlock]) -> None:
        """Undo the decrements of a `free_blocks` call that found a caller error."""
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1

    def _record_block_stored(
        self, request: KVCacheRequest, announced: list[int], block_size: int, group_id: int
    ) -> None:
        """One BlockStored event per run of consecutive announced block indices.

        A run is a chain, each block's parent the one before it, so a gap (a hash already cached,
        or a skipped block) starts a new event whose parent is the block just before the run.
        """
        tokens = request.all_token_ids
        hashes = request.block_hashes
        runs: list[list[int]] = []
        for idx in announced:
            if runs and runs[-1][-1] == idx - 1:
                runs[-1].append(idx)
            else:
                runs.append([idx])
        for run in runs:
            first, last = run[0], run[-1]
            self.kv_event_queue.append(
                block_stored(
                    [bytes(hashes[i]) for i in range(first, last + 1)],
                    bytes(hashes[first - 1]) if first > 0 else None,
                    tokens[first * block_size : (last + 1) * block_size].tolist(),
                    block_size,
                    group_id,
                )
            )
