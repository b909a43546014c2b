"""KVTiers: the engine's policy for the host and disk tiers below the device pool (DESIGN.md §3.5).

It decides every copy between the pool and the tiers, gathers each step's copies for the ranks
(KVTransfers), and turns the ranks' reports of failed disk slots into misses. The ranks own the
slots' memory and only copy; this module owns no memory and does no I/O.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine_core.kv_cache.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
)
from engine_core.kv_cache.spec import PREFIX_ATTENTION_SPECS, KVCacheGroupSpec
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


def describe_unsupported_tiers(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> str | None:
    """Why these KV-cache groups cannot have tiers below the pool, or None if they can.

    The tiers serve one full-attention (or MLA) group: a hit there is a whole prefix, so a
    lower-tier run simply extends the pool's. Sliding windows, Mamba states and hybrid models
    need their own rules of which blocks a hit reads, not built yet: refused at startup rather
    than risk a wrong token.
    """
    kinds = [type(group.spec).__name__ for group in kv_cache_groups]
    if len(kv_cache_groups) == 1 and isinstance(kv_cache_groups[0].spec, PREFIX_ATTENTION_SPECS):
        return None
    return (
        f"--kv-offload-host-bytes: the tiers below the pool serve models with one full-attention "
        f"(or MLA) KV-cache group, and this model has {kinds}: turn the tiers off"
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
        num_host_slots: int,
        num_disk_slots: int,
        block_size: int,
        stats: PrefixCacheStats,
        record_event: Callable[[KVCacheEvent], None] | None = None,
    ) -> None:
        if num_disk_slots and not num_host_slots:
            raise ValueError(
                f"a disk tier of {num_disk_slots} slots needs a host tier above it: got none"
            )
        self.host = TierIndex(num_host_slots, MEDIUM_CPU)
        self.disk = TierIndex(num_disk_slots, MEDIUM_DISK) if num_disk_slots else None
        self.block_size = block_size  # tokens per block, for the events
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

    # ---- the pool evicts ------------------------------------------------------------------

    def on_device_evict(self, block_id: int, key: BlockHashWithGroupId) -> None:
        """The pool is reusing block `block_id`, cached under `key`: copy it down first.

        The page is final: only full blocks are hashed, and a hashed block's tokens were
        scheduled in this step's predecessors (or it was uncached when its step dropped it), so
        the ranks have written it before they run this step's copies.
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

    def find_host_hits(
        self, block_hashes: Sequence[BlockHash], start_idx: int, stop_idx: int, suffix: bytes
    ) -> list[int]:
        """The host slots of blocks `start_idx, start_idx + 1, ...` up to the first host miss
        (or `stop_idx`), each marked most recently used. Pins nothing."""
        host = self.host
        slots: list[int] = []
        for idx in range(start_idx, stop_idx):
            slot = host.lookup(block_hashes[idx] + suffix)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def is_waiting_for_disk(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        start_idx: int,
        stop_idx: int,
        suffix: bytes,
    ) -> bool:
        """Whether the request should wait a step for its disk hits to reach the host tier.

        From block `start_idx` (the first the pool and the host tier miss) it starts a
        disk -> host copy of each block on disk, up to the first block found nowhere. The
        request waits while any of those host slots is unconfirmed, and waits at most once per
        admission: if its promoted blocks are gone by then (evicted, or a failed checksum), it
        computes them.
        """
        if self.disk is None or req_id in self._has_waited:
            return False
        awaited = self._awaited_slots.get(req_id)
        if awaited is not None:
            if awaited & self.host.pending:
                return True
            del self._awaited_slots[req_id]
            self._has_waited.add(req_id)
            return False
        awaited = self._promote_from_disk(req_id, block_hashes, start_idx, stop_idx, suffix)
        if not awaited:
            return False
        self._awaited_slots[req_id] = awaited
        return True

    def _promote_from_disk(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        start_idx: int,
        stop_idx: int,
        suffix: bytes,
    ) -> set[int]:
        """Start the disk -> host copies of a request's next blocks; the host slots awaited."""
        host, disk = self.host, self.disk
        assert disk is not None
        awaited: set[int] = set()
        promoted = self._promoted_keys.setdefault(req_id, set())
        for idx in range(start_idx, stop_idx):
            key = block_hashes[idx] + suffix
            host_slot = host.slot_of(key)
            if host_slot is not None:  # on its way up already, or readable: keep it this step
                if host_slot in host.pending:
                    awaited.add(host_slot)
                else:
                    host.pinned.add(host_slot)
                continue
            disk_slot = disk.lookup(key)
            if disk_slot is None:
                break
            disk.pinned.add(disk_slot)  # read this step: no write may take it first
            host_slot = self._claim_host_slot(key)
            if host_slot is None:
                break
            host.pending.add(host_slot)
            self._disk_to_host.append((disk_slot, host_slot))
            self._disk_copies.reads.append(_DiskCopy(disk_slot, key, host_slot))
            self.stats.blocks_from_disk += 1
            promoted.add(key)
            awaited.add(host_slot)
        return awaited

    # ---- admission copies in ------------------------------------------------------------

    def pin_host_slots(self, slots: Sequence[int]) -> None:
        """Keep these host hits from eviction by this step's allocations (they are read last)."""
        self.host.pinned.update(slots)

    def copy_in(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy each host hit into the fresh device block that now caches its key."""
        host_to_device = self._host_to_device
        for slot, block_id in zip(slots, block_ids, strict=True):
            assert slot in self.host.pinned, f"host slot {slot} is read without a pin"
            host_to_device.pop(block_id, None)  # a block freed and reused this step: last wins
            host_to_device[block_id] = slot
        self.stats.blocks_from_host += len(slots)

    def count_disk_hits(self, req_id: str, slots: Sequence[int]) -> int:
        """How many of an admitted request's host hits were fetched from disk for it."""
        promoted = self._promoted_keys.pop(req_id, None)
        self._awaited_slots.pop(req_id, None)
        if not promoted:
            return 0
        key_of = self.host.key_of
        return sum(1 for slot in slots if key_of(slot) in promoted)

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
                    self.block_size,
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
