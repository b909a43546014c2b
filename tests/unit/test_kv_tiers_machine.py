"""The KV-cache manager's state machine with host and disk tiers below a tiny pool: the pool,
the tiers' indexes and the ranks' tier memory, modelled as dicts, driven together.

Each allocation ends a step: its copies run on the modelled memory in KVTransfers' order before
the workers write its tokens, and its reply (with the disk slots that failed) may come a step
later, as with asynchronous scheduling. Every token's attention reads are checked against the
modelled pages (kv_manager_machine.py), so a copy-in of the wrong content fails the run.
"""

from collections import deque

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule
from kv_manager_machine import BRUTE_FORCE_SPECS, KVCacheManagerModelMachine, Scheduled
from kv_specs import full_spec, window_spec
from test_kv_manager_machines import chunked_local_spec, rswa_spec

from engine_core.kv_cache.hashing import get_group_id
from engine_core.kv_cache.kv_tiers import KVTiers
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, RSWASpec
from engine_core.kv_cache.tier_hits import TierHit
from engine_core.kv_cache.tier_index import TierIndex
from engine_core.sched.request import Request, RequestStatus
from protocol.buffers import pack_int32, unpack_int32
from protocol.worker_messages import KVTransfers

Page = dict[int, object]  # position in block -> what the K/V written there depends on


def _pairs(data: bytes) -> list[tuple[int, int]]:
    values = unpack_int32(data)
    return list(zip(values[::2], values[1::2], strict=True))


class KVTiersMachine(KVCacheManagerModelMachine):
    """Admissions, steps, preemptions and finishes over a pool of 9 blocks of 2 tokens, with a
    host tier of 3 slots and a disk tier of 10, so most hits come from a lower tier.

    Invariants, after every rule: the pool's and the tiers' own (a key lives in at most one slot
    per tier); every readable slot of a tier holds, in the modelled memory, exactly the page its
    key names; no copy reads a slot that was never written (or whose write or read failed).
    """

    specs = (full_spec(2),)
    num_blocks = 9
    num_host_slots = 3
    num_disk_slots = 10

    def __init__(self) -> None:
        super().__init__()
        self.host_memory: dict[int, Page | None] = {}  # None: the copy into it failed
        self.disk_memory: dict[int, Page | None] = {}
        self.corrupt_disk_slots: set[int] = set()  # their next read fails its checksum
        self.fails_next_disk_write = False
        self.step_id = 0
        self.unanswered: deque[tuple[int, list[int]]] = deque()  # (step id, failed disk slots)
        self.expected_pages: dict[bytes, Page] = {}  # key -> the page its tokens make
        self.num_transfers = 0
        self.disk_waiters: list[Request] = []  # waiting for disk hits, most recent last

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        groups = [KVCacheGroupSpec([f"g{idx}"], spec) for idx, spec in enumerate(self.specs)]
        config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_groups=groups,
            num_host_slots=self.num_host_slots,
            num_disk_slots=self.num_disk_slots,
        )
        self.manager = KVCacheManager(config, self.max_model_len, enable_kv_cache_events=True)

    @property
    def tiers(self) -> KVTiers:
        assert self.kv.tiers is not None
        return self.kv.tiers

    # ---- the steps: copies, then writes; replies a step late ------------------------------

    def before_writes(self, scheduled: list[Scheduled]) -> None:
        for planned in scheduled:
            request = planned.request
            num_tokens = min(planned.start + planned.num_new, request.num_tokens)
            for group_id, (spec, size) in enumerate(zip(self.specs, self.block_sizes, strict=True)):
                num_full = num_tokens // size
                if isinstance(spec, RSWASpec):  # it caches prompt blocks only: a generated
                    num_full = min(num_full, request.num_prompt_tokens // size)  # token differs
                for idx in range(num_full):  # what each full block's key names
                    positions = range(idx * size, (idx + 1) * size)
                    page = {pos % size: self.slot_content(request, spec, pos) for pos in positions}
                    self.expected_pages[self._key(request, group_id, idx)] = page
        self._end_step()

    def _end_step(self) -> None:
        """Take the step's copies, run them on the modelled memory, and queue its reply."""
        self.step_id += 1
        transfers = self.kv.take_kv_transfers(self.step_id)
        failed = [] if transfers is None else self._run_copies(transfers)
        if len(self.unanswered) == 2:  # asynchronous scheduling: at most two in flight
            self.reply()
        self.unanswered.append((self.step_id, failed))

    def _run_copies(self, transfers: KVTransfers) -> list[int]:
        """One rank's copies in field order; the disk slots that failed."""
        failed: list[int] = []
        for host_slot, disk_slot in _pairs(transfers.host_to_disk):
            page = self._read(self.host_memory, host_slot, "host")
            if self.fails_next_disk_write:
                self.fails_next_disk_write = False
                self.disk_memory[disk_slot] = None
                failed.append(disk_slot)
            else:
                self.disk_memory[disk_slot] = page
            self.corrupt_disk_slots.discard(disk_slot)
        for block_id, host_slot in _pairs(transfers.device_to_host):
            # The whole page: a block id may hold positions of a larger group it served before,
            # which a check of the key's group ignores (_page_of).
            page = dict(self.slots[block_id])
            assert len(page) >= min(self.block_sizes), f"block {block_id} copied out unfull"
            self.host_memory[host_slot] = page
        for disk_slot, host_slot in _pairs(transfers.disk_to_host):
            if disk_slot in self.corrupt_disk_slots or self.disk_memory.get(disk_slot) is None:
                self.host_memory[host_slot] = None  # the checksum failed: nothing copied
                failed.append(disk_slot)
            else:
                self.host_memory[host_slot] = self._read(self.disk_memory, disk_slot, "disk")
        for host_slot, block_id in _pairs(transfers.host_to_device):
            self.slots[block_id] = dict(self._read(self.host_memory, host_slot, "host"))
        self.num_transfers += 1
        return failed

    @staticmethod
    def _read(memory: dict[int, Page | None], slot: int, tier: str) -> Page:
        page = memory.get(slot)
        assert page is not None, f"{tier} slot {slot} is read before anything valid was written"
        return page

    @precondition(lambda self: self.unanswered)
    @rule()
    def reply(self) -> None:
        """The oldest step in flight answers, with the disk slots that failed on its ranks."""
        step_id, failed = self.unanswered.popleft()
        self.kv.on_step_reply(step_id, pack_int32(failed))

    @rule()
    def answer_all(self) -> None:
        """The ranks catch up: every step in flight answers (a waiting request may go next)."""
        while self.unanswered:
            self.reply()

    @precondition(lambda self: self.disk_waiters)
    @rule()
    def readmit_disk_waiter(self) -> None:
        """The scheduler's next look at a request that waited for its disk hits: the steps in
        flight answered, it is admitted with them (or computes what failed or was evicted)."""
        request = self.disk_waiters.pop()
        if request not in self.waiting:
            return  # readmitted already by another rule
        self.answer_all()
        self.waiting.remove(request)
        self._admit_now(request)

    @rule()
    def empty_step(self) -> None:
        """A step that allocates nothing: promotions started by a waiting request go out."""
        self._end_step()

    @precondition(lambda self: self.disk_memory)
    @rule(data=st.data())
    def corrupt_disk_slot(self, data: st.DataObject) -> None:
        """A disk slot rots: its next read fails its checksum on the ranks."""
        self.corrupt_disk_slots.add(data.draw(st.sampled_from(sorted(self.disk_memory))))

    @rule()
    def fail_next_disk_write(self) -> None:
        self.fails_next_disk_write = True

    # ---- admissions: lower-tier hits and disk waits ----------------------------------------

    def _admit_now(self, request: Request) -> None:
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if hits.is_waiting_for_disk:
            self._end_step()  # its disk -> host copies go out; it waits for their replies
            self.waiting.append(request)
            self.disk_waiters.append(request)
            return
        self._check_hits(request, hits, num_hit_tokens)
        num_new = min(request.num_tokens - num_hit_tokens, self.max_chunk_tokens)
        if self._allocate(request, num_new, num_hit_tokens, hits) is None:
            self.waiting.append(request)
            return
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_new
        self.running.append(request)
        self._execute([Scheduled(request, num_hit_tokens, num_new, is_admission=True)])

    def _check_hits(
        self,
        request: Request,
        hits: KVCacheBlocks,
        num_hit_tokens: int,
        check_contents: bool = True,
    ) -> None:
        """The hit is the longest the pool and the host tier serve together (the brute force
        of the base machine, with host slots as cached), and each hit block holds its key's
        page: in the pool, or in the host slot a TierHit names."""
        if all(isinstance(spec, BRUTE_FORCE_SPECS) for spec in self.specs):
            assert num_hit_tokens == self._brute_force_hit_length(request), request
        assert num_hit_tokens % self.alignment == 0 and num_hit_tokens < request.num_tokens
        host = self.tiers.host
        for group_id, blocks in enumerate(hits.blocks):
            spec, size = self.specs[group_id], self.block_sizes[group_id]
            assert len(blocks) == num_hit_tokens // size
            read_from = min(self.read_positions(request, spec, num_hit_tokens))
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert (idx + 1) * size <= read_from, f"null hit {idx} is still read"
                    continue
                key = self._key(request, group_id, idx)
                assert block.block_hash == key, (idx, block)
                if isinstance(block, TierHit):
                    slot = block.tier_slot
                    assert not block.is_on_disk, "a disk hit was offered for admission"
                    assert host.key_of(slot) == key and slot not in host.pending, (slot, block)
                    held = self._page_of(self.host_memory.get(slot), size)
                else:
                    held = self._page_of(self.slots[block.block_id], size)
                if not check_contents:
                    continue
                assert held == self.expected_pages[key], f"false hit: {block!r} holds {held}"

    def _is_cached(self, request: Request, group_id: int, idx: int) -> bool:
        """In the pool, or readable in the host tier (a disk hit is first waited for)."""
        if super()._is_cached(request, group_id, idx):
            return True
        slot = self.tiers.host.slot_of(self._key(request, group_id, idx))
        return slot is not None and slot not in self.tiers.host.pending

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def tiers_hold_their_keys_pages(self) -> None:
        """Every readable slot holds, in the modelled memory, the page its key names."""
        if self.manager is None:
            return
        self.tiers.check_invariants()
        self._check_tier(self.tiers.host, self.host_memory)
        if self.tiers.disk is not None:
            self._check_tier(self.tiers.disk, self.disk_memory)

    def _check_tier(self, index: TierIndex, memory: dict[int, Page | None]) -> None:
        keys = index.held_keys()
        assert len(keys) == len(set(keys)), f"a key lives in two {index.medium} slots"
        for key in keys:
            slot = index.slot_of(key)
            assert slot is not None
            if slot in index.pending:
                continue  # its copy is unconfirmed: neither a hit nor a source yet
            held = self._page_of(memory.get(slot), self.block_sizes[get_group_id(key)])
            assert held == self.expected_pages[key], (
                f"{index.medium} slot {slot} holds {held}, its key "
                f"{key.hex()[:8]} names {self.expected_pages[key]}"
            )

    @staticmethod
    def _page_of(page: Page | None, size: int) -> Page | None:
        """The positions of a block of `size` tokens in a modelled page."""
        return None if page is None else {i: c for i, c in page.items() if i < size}

    def teardown(self) -> None:
        if self.manager is not None:
            while self.unanswered:
                self.reply()
        super().teardown()


class HostOnlyTiersMachine(KVTiersMachine):
    """A host tier alone: pool evictions go to host memory, host evictions are dropped."""

    num_disk_slots = 0


class HybridTiersMachine(KVTiersMachine):
    """Full attention beside a window of 5 tokens, blocks of 2: the hybrid fixed point finds
    hits in the pool and the host tier together, each group by its own rule."""

    specs = (full_spec(2), window_spec(5, 2))
    num_blocks = 17
    num_host_slots = 6
    num_disk_slots = 12


class MixedSizesTiersMachine(KVTiersMachine):
    """Full attention in blocks of 2 beside a window in blocks of 4: hashes at 2, hits on 4,
    and a tier slot holds whichever group's page its key names."""

    specs = (full_spec(2), window_spec(5, 4))
    num_blocks = 25
    num_host_slots = 6
    num_disk_slots = 12


class LocalTiersMachine(KVTiersMachine):
    """Chunked-local attention (chunks of 4) beside full attention: a hit reads its own chunk."""

    specs = (full_spec(2), chunked_local_spec(4))
    num_blocks = 17
    num_host_slots = 6
    num_disk_slots = 12


class RSWATiersMachine(KVTiersMachine):
    """R-SWA alone: only prompt blocks are cached, so only they ever tier."""

    specs = (rswa_spec(3),)
    num_blocks = 11


TestKVTiersMachine = KVTiersMachine.TestCase
TestKVTiersMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestHostOnlyTiersMachine = HostOnlyTiersMachine.TestCase
TestHostOnlyTiersMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestHybridTiersMachine = HybridTiersMachine.TestCase
TestHybridTiersMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestLocalTiersMachine = LocalTiersMachine.TestCase
TestLocalTiersMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestRSWATiersMachine = RSWATiersMachine.TestCase
TestRSWATiersMachine.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestMixedSizesTiersMachine = MixedSizesTiersMachine.TestCase
TestMixedSizesTiersMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None
)
