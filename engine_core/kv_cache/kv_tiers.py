"""KVTiers: the engine's policy for the host and disk tiers below the device pool (DESIGN.md §3.5).

It decides every copy between the pool and the tiers, gathers each step's copies for the ranks
(KVTransfers), and turns the ranks' reports of failed disk slots into misses. The ranks own the
slots' memory and only copy; this module owns no memory and does no I/O.
"""

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHashWithGroupId, get_block_hash, get_group_id
from engine_core.kv_cache.spec import (
    PREFIX_ATTENTION_SPECS,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from engine_core.kv_cache.tier_hits import TierHit, TierHitView
from engine_core.kv_cache.tier_index import TierIndex
from protocol.buffers import pack_int32, unpack_int32
from protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, KVCacheEvent, block_removed, block_stored
from protocol.stats import PrefixCacheStats
from protocol.worker_messages import KVTransfers

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class _DiskCopy:
    """One disk read or write of a step, kept until the step's reply confirms or fails it."""

    disk_slot: int
    key: BlockHashWithGroupId
    host_slot: int | None  # a read's destination; None for a write


@dataclass(slots=True)
class _StepDiskCopies:
    reads: list[_DiskCopy] = field(default_factory=list)  # disk_to_host
    writes: list[_DiskCopy] = field(default_factory=list)  # host_to_disk


# The kinds whose hit scans read the pool only through its lookups, so TierHitView serves them.
# A Mamba state block (align mode) is a row of the ranks' shared tensors like any page.
TIERED_SPECS = (
    *PREFIX_ATTENTION_SPECS,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
    RSWASpec,
    MambaSpec,
)


def describe_unsupported_tiers(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> str | None:
    """Why these KV-cache groups cannot have tiers below the pool, or None if they can.

    Every kind kvserve knows looks its hits up through TierHitView, each by its own rule (full
    attention's prefix, a window's run, a chunk, Mamba's last state in align mode), alone or in
    a hybrid; cross-attention groups never hash a block, so they never tier. A kind added later
    is refused here until its hit rule is checked against the tiers.
    """
    refused = [
        type(group.spec).__name__
        for group in kv_cache_groups
        if not isinstance(group.spec, (*TIERED_SPECS, CrossAttentionSpec))
    ]
    if not refused:
        return None
    return (
        "--kv-offload-host-bytes: the tiers below the pool do not serve the KV-cache groups "
        f"{sorted(set(refused))} of this model yet: turn the tiers off"
    )


def _pack_pairs(pairs: Sequence[tuple[int, int]]) -> bytes:
    return pack_int32([value for pair in pairs for value in pair])


class KVTiers:
    """One LRU index per tier (key -> slot) and the copies of the step being planned.

    The hierarchy is inclusive: a key copied up keeps its lower copy, so a block the pool evicts
    again costs no copy when the host tier still holds it, and a host victim already on disk
    costs none either. LRU within a tier, because a tier's hits are prefixes that come back
    (multi-turn chat, shared documents): the longer since a prefix was last used, the less
    likely it returns, and the pool already evicts a prefix's tail before its head.

    The ranks run a step's lists in the order of KVTransfers' fields: host_to_disk,
    device_to_host, disk_to_host, host_to_device, then the forward. So within one step a slot
    that a list writes is pinned (an earlier list, host_to_disk, would read it before the write),
    and so is a slot that host_to_device reads (an earlier list would overwrite it); a host
    victim's slot may be rewritten in the same step, since host_to_disk reads it first.

    Disk copies are unconfirmed until their step's reply: a slot written or read is `pending`
    (no hit, no victim) until the reply lists no failure for it; a failure drops the key, so a
    bad checksum is a miss and never a wrong token.

    Invariants: each tier's (TierIndex); every pending slot has an unconfirmed copy of a step in
    flight or of the step being planned.
    """

    def __init__(
        self,
        pool: BlockPool,
        num_host_slots: int,
        num_disk_slots: int,
        block_sizes: Sequence[int],
        stats: PrefixCacheStats,
        record_event: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        """Args:
        block_sizes: tokens per block of each KV-cache group, by group id.
        record_event: queues a KV event in order with the pool's; None records none.
        """
        if num_disk_slots and not num_host_slots:
            raise ValueError(
                f"a disk tier of {num_disk_slots} slots needs a host tier above it: got none"
            )
        self.host = TierIndex(num_host_slots, MEDIUM_CPU)
        self.disk = TierIndex(num_disk_slots, MEDIUM_DISK) if num_disk_slots else None
        self.pool = pool
        self.block_sizes = list(block_sizes)
        self.stats = stats  # the KV-cache manager's live totals
        self._record_event = record_event
        # The step being planned, in KVTransfers' field order.
        self._host_to_disk: list[tuple[int, int]] = []
        self._device_to_host: list[tuple[int, int]] = []
        self._disk_to_host: list[tuple[int, int]] = []
        self._host_to_device: dict[int, int] = {}  # block id -> host slot: the last copy wins
        self._disk_copies = _StepDiskCopies()
        self._unconfirmed: dict[int, _StepDiskCopies] = {}  # step id -> its disk copies
        # Disk hits: the host slots each request waits for, and who waited once already.
        self._awaited_slots: dict[str, set[int]] = {}
        self._has_waited: set[str] = set()
        self._promoted_keys: dict[str, set[BlockHashWithGroupId]] = {}
        # The views of every lookup, without and with the disk tier: they hold no lookup's state.
        self._views = (
            TierHitView(pool, self.host, self.disk, include_disk=False),
            TierHitView(pool, self.host, self.disk, include_disk=True),
        )

    # ---- the pool evicts ------------------------------------------------------------------

    def on_device_evict(self, block_id: int, key: BlockHashWithGroupId) -> None:
        """The pool is reusing block `block_id`, cached under `key`: copy it down first.

        The copy runs before this step's forward, and the page is final by then, asynchronous
        scheduling included. Only full blocks are hashed, and only over known tokens (a step's
        placeholder token is hashed once it arrives), so the step that writes a hashed block's
        tokens was planned no later than the hash was set; a step dropped before it ran takes
        its hashes with it (`uncache_unwritten`, Mamba's pending checkpoints). The ranks run
        steps in order, so every step planned before this one has written its pages when this
        one's copies start, and no later step writes a full block again. A block freed while a
        step in flight still writes it is thus never hashed, or hashed and already final.
        """
        host = self.host
        if key in host:  # inclusive: the host copy is as good (and a pending one soon will be)
            host.touch(key)
            return
        slot = self._claim_host_slot(key)
        if slot is None:
            return  # every host slot is read or written this step: the block is dropped
        self._device_to_host.append((block_id, slot))
        self.stats.blocks_to_host += 1
        self._emit_stored(key, MEDIUM_CPU)

    # ---- lookups ----------------------------------------------------------------------------

    def view(self, include_disk: bool) -> TierHitView:
        """The pool's lookups extended into the host tier, and the disk tier if asked."""
        return self._views[include_disk and self.disk is not None]

    def is_awaiting_disk(self, req_id: str) -> bool:
        """Whether the request's disk hits are still on their way up (their copies unconfirmed).

        Once they are confirmed (or failed) it waits no more in this admission: its next lookup
        leaves the disk tier out, so a prefix evicted again meanwhile cannot hold it forever.
        """
        awaited = self._awaited_slots.get(req_id)
        if awaited is None:
            return False
        if awaited & self.host.pending:
            return True
        del self._awaited_slots[req_id]
        self._has_waited.add(req_id)
        return False

    def can_wait_for_disk(self, req_id: str) -> bool:
        return self.disk is not None and req_id not in self._has_waited

    def promote(self, req_id: str, hits: Sequence[TierHit]) -> bool:
        """Start the disk -> host copies of a lookup's disk hits; whether the request waits.

        Its host hits are pinned first, so that making room for the copies cannot evict them.
        The request waits while any of the host slots it needs is unconfirmed.
        """
        host, disk = self.host, self.disk
        assert disk is not None
        host.pinned.update(hit.tier_slot for hit in hits if not hit.is_on_disk)
        awaited: set[int] = set()
        promoted = self._promoted_keys.setdefault(req_id, set())
        for hit in hits:
            key = hit.block_hash
            if not hit.is_on_disk or key is None:
                continue
            host_slot = host.slot_of(key)
            if host_slot is not None:  # already on its way up, for another request
                if host_slot in host.pending:
                    awaited.add(host_slot)
                    promoted.add(key)  # it reaches this request from disk too
                continue
            disk_slot = disk.lookup(key)
            if disk_slot is None:
                continue
            disk.pinned.add(disk_slot)  # read this step: no write may take it first
            host_slot = self._claim_host_slot(key)
            if host_slot is None:
                break  # every host slot is pinned or pending: the rest is computed
            host.pending.add(host_slot)
            self._disk_to_host.append((disk_slot, host_slot))
            self._disk_copies.reads.append(_DiskCopy(disk_slot, key, host_slot))
            self.stats.blocks_from_disk += 1
            promoted.add(key)
            awaited.add(host_slot)
        if not awaited:
            return False
        self._awaited_slots[req_id] = awaited
        return True

    # ---- admission copies in ------------------------------------------------------------

    def pin_host_slots(self, slots: Iterable[int]) -> None:
        """Keep these host hits from eviction by this step's allocations (they are read last)."""
        self.host.pinned.update(slots)

    def copy_in(self, slot: int, block_id: int) -> None:
        """Copy a host hit into the fresh device block that now caches its key."""
        host = self.host
        key = host.key_of(slot)
        assert key is not None and slot in host.pinned, f"host slot {slot} is read unpinned"
        host.touch(key)
        self._host_to_device.pop(block_id, None)  # a block freed and reused this step: last wins
        self._host_to_device[block_id] = slot
        self.stats.blocks_from_host += 1

    def count_admitted_hits(
        self, req_id: str, computed: Sequence[Sequence[KVCacheBlock]]
    ) -> tuple[int, int]:
        """An admitted lookup's tier hits in tokens, each counted once in the tier it came
        from: the host tier's own, and those fetched up from disk for the request (which the
        host tier then hands in); per tier in the group that took most (each group holds its
        own copy of the same tokens). The request's admission is over: its disk wait is
        forgotten."""
        promoted = self._promoted_keys.get(req_id, set())
        num_host_tokens = num_disk_tokens = 0
        for blocks, block_size in zip(computed, self.block_sizes, strict=True):
            keys = [block.block_hash for block in blocks if isinstance(block, TierHit)]
            num_disk_blocks = sum(1 for key in keys if key in promoted)
            num_host_tokens = max(num_host_tokens, (len(keys) - num_disk_blocks) * block_size)
            num_disk_tokens = max(num_disk_tokens, num_disk_blocks * block_size)
        self.forget_request(req_id)
        return num_host_tokens, num_disk_tokens

    def forget_request(self, req_id: str) -> None:
        """The request freed its blocks (finished or preempted): its next admission may wait."""
        self._awaited_slots.pop(req_id, None)
        self._has_waited.discard(req_id)
        self._promoted_keys.pop(req_id, None)

    # ---- the step's copies and their replies ----------------------------------------------

    def has_transfers(self) -> bool:
        return bool(
            self._host_to_disk or self._device_to_host or self._disk_to_host or self._host_to_device
        )

    def take_transfers(self, step_id: int) -> KVTransfers | None:
        """The copies of step `step_id`, now planned; None when there are none. Unpins."""
        self.host.pinned.clear()
        if self.disk is not None:
            self.disk.pinned.clear()
        if not self.has_transfers():
            return None
        transfers = KVTransfers(
            _pack_pairs(self._host_to_disk),
            _pack_pairs(self._device_to_host),
            _pack_pairs(self._disk_to_host),
            _pack_pairs([(slot, block_id) for block_id, slot in self._host_to_device.items()]),
        )
        copies = self._disk_copies
        if copies.reads or copies.writes:
            self._unconfirmed[step_id] = copies
        self._host_to_disk, self._device_to_host, self._disk_to_host = [], [], []
        self._host_to_device = {}
        self._disk_copies = _StepDiskCopies()
        return transfers

    def on_step_reply(self, step_id: int, failed_disk_slots: bytes) -> None:
        """Confirm step `step_id`'s disk copies; a failed slot (any rank's) becomes a miss."""
        copies = self._unconfirmed.pop(step_id, None)
        failed = set(unpack_int32(failed_disk_slots)) if failed_disk_slots else set()
        if copies is None:
            if failed:
                logger.warning(
                    "step %d reported failed disk slots %s, but it copied none: ignored",
                    step_id,
                    sorted(failed),
                )
            return
        known = {copy.disk_slot for copy in copies.writes} | {c.disk_slot for c in copies.reads}
        if failed - known:
            logger.warning(
                "step %d reported failed disk slots %s that it did not copy: ignored",
                step_id,
                sorted(failed - known),
            )
        for copy in copies.writes:
            self._confirm_write(copy, copy.disk_slot in failed)
        for copy in copies.reads:
            self._confirm_read(copy, copy.disk_slot in failed)
        if failed & known:
            logger.warning(
                "disk tier: slots %s of step %d failed (checksum or write): treated as misses",
                sorted(failed & known),
                step_id,
            )

    def _confirm_write(self, copy: _DiskCopy, has_failed: bool) -> None:
        disk = self.disk
        assert disk is not None
        if disk.slot_of(copy.key) != copy.disk_slot:
            return  # evicted since: nothing of it is left to confirm
        if has_failed:
            self.stats.disk_write_failures += 1
            disk.remove(copy.key)
            self._emit_removed([copy.key], MEDIUM_DISK)
        else:
            disk.pending.discard(copy.disk_slot)

    def _confirm_read(self, copy: _DiskCopy, has_failed: bool) -> None:
        host, disk = self.host, self.disk
        assert disk is not None and copy.host_slot is not None
        is_held = host.slot_of(copy.key) == copy.host_slot
        if has_failed:
            self.stats.disk_read_failures += 1
            if is_held:
                host.remove(copy.key)  # pending: no CPU store was announced
            if disk.slot_of(copy.key) == copy.disk_slot:
                disk.remove(copy.key)
                self._emit_removed([copy.key], MEDIUM_DISK)
        elif is_held and copy.host_slot in host.pending:
            host.pending.discard(copy.host_slot)
            host.touch(copy.key)
            self._emit_stored(copy.key, MEDIUM_CPU)

    def clear(self) -> None:
        """Forget both tiers (the ranks' tier memory is gone, or a reset): every key leaves."""
        logger.info(
            "tiers below the pool cleared: %d host and %d disk blocks forgotten",
            len(self.host),
            0 if self.disk is None else len(self.disk),
        )
        self._emit_removed(
            [k for k in self.host.held_keys() if self._is_announced_host(k)], MEDIUM_CPU
        )
        if self.disk is not None:
            self._emit_removed(self.disk.held_keys(), MEDIUM_DISK)
            self.disk.clear()
        self.host.clear()
        self._host_to_disk, self._device_to_host, self._disk_to_host = [], [], []
        self._host_to_device = {}
        self._disk_copies = _StepDiskCopies()
        self._unconfirmed.clear()
        self._awaited_slots.clear()
        self._has_waited.clear()
        self._promoted_keys.clear()

    # ---- slots --------------------------------------------------------------------------

    def _claim_host_slot(self, key: BlockHashWithGroupId) -> int | None:
        """A host slot for `key`, pinned for this step: a free one, or the LRU victim's after
        moving it down to disk; None when every slot is pinned or pending."""
        host = self.host
        if not host.has_free_slot():
            victim = host.find_victim()
            if victim is None:
                return None
            self._evict_host(*victim)
        return host.insert(key)

    def _evict_host(self, key: BlockHashWithGroupId, slot: int) -> None:
        """Drop a host key, copying it to disk first when a disk tier holds no copy yet."""
        self.host.remove(key)
        self._emit_removed([key], MEDIUM_CPU)
        disk = self.disk
        if disk is None:
            return
        if key in disk:
            disk.touch(key)
            return
        if not disk.has_free_slot():
            victim = disk.find_victim()
            if victim is None:
                return  # every disk slot is read, written or unconfirmed: the block is dropped
            disk.remove(victim[0])
            self._emit_removed([victim[0]], MEDIUM_DISK)
        disk_slot = disk.insert(key)
        disk.pending.add(disk_slot)  # unconfirmed until the step's reply
        self._host_to_disk.append((slot, disk_slot))  # the first list: read before the reuse
        self._disk_copies.writes.append(_DiskCopy(disk_slot, key, None))
        self.stats.blocks_to_disk += 1
        self._emit_stored(key, MEDIUM_DISK)

    # ---- events and checks ----------------------------------------------------------------

    def _is_announced_host(self, key: BlockHashWithGroupId) -> bool:
        slot = self.host.slot_of(key)
        return slot is not None and slot not in self.host.pending

    def _emit_stored(self, key: BlockHashWithGroupId, medium: str) -> None:
        if self._record_event is not None:
            self._record_event(
                block_stored(
                    [bytes(get_block_hash(key))],
                    None,
                    [],
                    self.block_sizes[get_group_id(key)],
                    get_group_id(key),
                    medium,
                )
            )

    def _emit_removed(self, keys: list[BlockHashWithGroupId], medium: str) -> None:
        if self._record_event is None or not keys:
            return
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            by_group.setdefault(get_group_id(key), []).append(bytes(get_block_hash(key)))
        for group_id, hashes in by_group.items():
            self._record_event(block_removed(hashes, group_id, medium))

    def check_invariants(self) -> None:
        """Each tier's invariants, and every pending slot awaits a recorded disk copy."""
        self.host.check_invariants()
        steps = [*self._unconfirmed.values(), self._disk_copies]
        awaited_host = {copy.host_slot for copies in steps for copy in copies.reads}
        assert self.host.pending <= awaited_host, (
            f"host slots {sorted(self.host.pending - awaited_host)} are pending with no disk read"
        )
        if self.disk is not None:
            self.disk.check_invariants()
            awaited_disk = {copy.disk_slot for copies in steps for copy in copies.writes}
            assert self.disk.pending <= awaited_disk, (
                f"disk slots {sorted(self.disk.pending - awaited_disk)} are pending with no write"
            )
