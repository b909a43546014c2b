"""Hypothesis state machines over KVCacheManager with a Mamba group, alone and beside full
attention, in both modes, with and without a prefix cache.

Each step plans several requests the way the Scheduler does (allocations first, computed tokens
advanced once the step is planned), then a stand-in for the workers runs the step as a batched
kernel would: every request loads its starting state before any state is stored. One dict
models the shared paged memory: an attention block holds a token per slot, a state block holds
the prefix of tokens its state summarises. Every state a step starts from, and every token
attention reads, is checked against it, so a false hit, a lost checkpoint, a block reused while
held, or a checkpoint read in the step that writes it fails the run.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    cdiv,
)
from engine_core.sched.block_aligned_chunks import BlockAlignedChunks
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2
MAX_MODEL_LEN = 24
MAX_CHUNK_TOKENS = 7
BASE_PROMPTS = ([7] * 12, list(range(100, 112)))  # prefixes requests share
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")
ALIGN = MambaSpec(BLOCK_SIZE, ((2, 2),), "float32", mamba_cache_mode="align")
ONE_BLOCK = MambaSpec(BLOCK_SIZE, ((2, 2),), "float32", mamba_cache_mode="none")

Scheduled = tuple[Request, int, int]  # a request, its first computed token this step, its count


class MambaKVCacheManagerMachine(RuleBasedStateMachine):
    """Admissions with shared prefixes, multi-request steps, decode, preemption, free, reset."""

    specs: tuple[KVCacheSpec, ...] = (ALIGN,)
    enable_caching = True
    num_blocks = 12
    # Whether a request allocated in a step may be preempted before the step is planned, as the
    # priority policy's victim can be. A state group takes back the checkpoint such a request
    # published; a full-attention group keeps the blocks it cached at allocation, whose K/V
    # are then never written, so the machines with one (and a prefix cache) do not drop.
    can_drop_planned = True

    def __init__(self) -> None:
        super().__init__()
        groups = [KVCacheGroupSpec([f"g{idx}"], spec) for idx, spec in enumerate(self.specs)]
        config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=groups)
        self.manager = KVCacheManager(config, MAX_MODEL_LEN, enable_caching=self.enable_caching)
        self.is_align = self.enable_caching and ALIGN in self.specs
        self.chunks = BlockAlignedChunks(BLOCK_SIZE, MAX_CHUNK_TOKENS)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # new and preempted, admitted in order
        self.num_requests = 0
        # block_id -> a list of tokens (attention slots) or a tuple (the prefix a state sums up)
        self.memory: dict[int, list[int | None] | tuple[int, ...]] = {}

    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        num_shared=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    )
    def add_request(self, base: list[int], num_shared: int, suffix: list[int]) -> None:
        self.num_requests += 1
        tokens = [*base[:num_shared], *suffix][: MAX_MODEL_LEN - 4]
        self.waiting.append(
            Request(f"r{self.num_requests}", tokens, SamplingParams(), block_hasher=self.hasher)
        )

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data(), is_aligned=st.booleans())
    def step(self, data: st.DataObject, is_aligned: bool) -> None:
        """Plan one step (running requests first, then admissions in order), then run it.

        `is_aligned` picks the scheduler's block-aligned chunks or arbitrary ones: the cache
        must stay right either way; alignment only makes more checkpoints.
        """
        scheduled: list[Scheduled] = []
        for request in list(self.running):
            if not data.draw(st.booleans(), label=f"run {request.req_id}"):
                continue
            if request.num_computed_tokens == request.num_tokens:
                if request.num_tokens >= MAX_MODEL_LEN:
                    self._finish(request)
                    continue
                request.append_output_token_ids(data.draw(st.integers(0, 3)))
            num_new = self._chunk(data, request, request.num_computed_tokens, is_aligned)
            if num_new and self._allocate(request, num_new) is None:
                self._preempt(request)
            elif num_new:
                scheduled.append((request, request.num_computed_tokens, num_new))
        num_admissions = data.draw(st.integers(0, 3), label="admissions")
        while self.waiting and num_admissions:
            num_admissions -= 1
            admitted = self._admit(data, self.waiting[0], is_aligned)
            if admitted is None:
                break  # head of line, as the scheduler admits
            scheduled.append(admitted)
        if self.can_drop_planned:
            for planned in list(scheduled):
                if data.draw(st.booleans(), label=f"drop {planned[0].req_id}"):
                    scheduled.remove(planned)  # preempted after its allocation: never runs
                    self._preempt(planned[0])
        for request, start, num_new in scheduled:  # the step is planned
            request.num_computed_tokens = start + num_new
        self._execute(scheduled)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._preempt(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    @rule()
    def finish_all(self) -> None:
        for request in list(self.running):
            self._finish(request)
        assert self.manager.block_pool.get_num_free_blocks() == self.num_blocks - 1  # no leak

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        group_of_block: dict[int, int] = {}
        for request in self.running:
            tables = self.manager.get_block_ids(request.req_id)
            for group_id, (spec, table) in enumerate(zip(self.specs, tables, strict=True)):
                expected = cdiv(request.num_computed_tokens, BLOCK_SIZE)
                if isinstance(spec, MambaSpec) and not self.is_align:
                    expected = 1
                assert len(table) == expected, f"{request!r} holds {table} in group {group_id}"
                for block_id in table:
                    if block_id:
                        held_by = group_of_block.setdefault(block_id, group_id)
                        assert held_by == group_id, (
                            f"block {block_id} is held in groups {held_by} and {group_id}"
                        )

    def teardown(self) -> None:
        self.finish_all()
        self.manager.check_invariants()

    def _chunk(self, data: st.DataObject, request: Request, start: int, is_aligned: bool) -> int:
        num_new = min(request.num_tokens - start, data.draw(st.integers(1, MAX_CHUNK_TOKENS)))
        if is_aligned and self.is_align:
            return self.chunks.clip(request, start, num_new)
        return num_new

    def _admit(self, data: st.DataObject, request: Request, is_aligned: bool) -> Scheduled | None:
        expected = self._longest_agreed_hit(request)
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == expected, f"{request.req_id} hits {num_hit_tokens}, not {expected}"
        self._check_hit_keys(request, hits, num_hit_tokens)
        num_new = self._chunk(data, request, num_hit_tokens, is_aligned)
        if not num_new or self._allocate(request, num_new, num_hit_tokens, hits) is None:
            return None
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens  # as the scheduler sets it at admission
        self.running.append(request)
        return request, num_hit_tokens, num_new

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hits: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        before = self._snapshot()
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocate_slots changed the pool"
        return new_blocks

    def _execute(self, scheduled: list[Scheduled]) -> None:
        """The workers' step: load every starting state, then store K/V and states, then read."""
        tables = {r.req_id: self.manager.get_block_ids(r.req_id) for r, _, _ in scheduled}
        for request, start, _ in scheduled:
            for group_id in self._mamba_group_ids():
                if start:
                    block_id = tables[request.req_id][group_id][self._state_idx(start)]
                    self._check_state(request, block_id, start)
        for request, start, num_new in scheduled:
            table = tables[request.req_id]
            tokens = request.all_token_ids
            for group_id, spec in enumerate(self.specs):
                if isinstance(spec, MambaSpec):
                    end = start + num_new
                    block_id = table[group_id][self._state_idx(end)]
                    assert block_id, f"{request.req_id} stores its state in the null block"
                    self.memory[block_id] = tuple(tokens[:end])
                    continue
                for pos in range(start, start + num_new):
                    block_id = table[group_id][pos // BLOCK_SIZE]
                    assert block_id, f"{request.req_id} writes token {pos} into the null block"
                    slots = self.memory.get(block_id)
                    if not isinstance(slots, list):
                        slots = self.memory[block_id] = [None] * BLOCK_SIZE
                    slots[pos % BLOCK_SIZE] = tokens[pos]
        for request, start, num_new in scheduled:
            for group_id, spec in enumerate(self.specs):
                if isinstance(spec, FullAttentionSpec):
                    table = tables[request.req_id][group_id]
                    self._check_attention_reads(request, table, start + num_new)

    def _state_idx(self, num_tokens: int) -> int:
        """Where the state after `num_tokens` tokens lives in a table."""
        return cdiv(num_tokens, BLOCK_SIZE) - 1 if self.is_align else 0

    def _mamba_group_ids(self) -> list[int]:
        return [idx for idx, spec in enumerate(self.specs) if isinstance(spec, MambaSpec)]

    def _check_state(self, request: Request, block_id: int, num_tokens: int) -> None:
        found = self.memory.get(block_id)
        expected = tuple(request.all_token_ids[:num_tokens])
        assert block_id and found == expected, (
            f"{request.req_id} starts from block {block_id} holding {found}, expected the "
            f"state after {expected}"
        )

    def _check_attention_reads(self, request: Request, table: list[int], end: int) -> None:
        for pos in range(end):
            block_id = table[pos // BLOCK_SIZE]
            slots = self.memory.get(block_id)
            found = slots[pos % BLOCK_SIZE] if isinstance(slots, list) else slots
            assert block_id and found == request.all_token_ids[pos], (
                f"{request.req_id} reads token {pos} from block {block_id}: found {found}"
            )

    def _longest_agreed_hit(self, request: Request) -> int:
        """The reference hit, by brute force over the pool's index: the longest block-aligned
        prefix (the last token excluded) that every full-attention group holds whole and whose
        last block's state every state group holds."""
        if not self.enable_caching:
            return 0
        pool = self.manager.block_pool
        hashes = request.block_hashes
        for num_blocks in range((request.num_tokens - 1) // BLOCK_SIZE, 0, -1):
            is_hit = True
            for group_id, spec in enumerate(self.specs):
                if isinstance(spec, MambaSpec):
                    needed = [num_blocks - 1] if spec.mamba_cache_mode == "align" else []
                    is_hit = is_hit and bool(needed)
                else:
                    needed = list(range(num_blocks))
                for idx in needed:
                    is_hit = is_hit and pool.get_cached_block(hashes[idx], [group_id]) is not None
            if is_hit:
                return num_blocks * BLOCK_SIZE
        return 0

    def _check_hit_keys(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """Each hit block carries the key of its position; a state hit is one block at the end."""
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens < request.num_tokens
        if num_hit_tokens:
            assert self.is_align, f"a hit of {num_hit_tokens} tokens without align mode"
        for group_id, blocks in enumerate(hits.blocks):
            assert len(blocks) == num_hit_tokens // BLOCK_SIZE
            for idx, block in enumerate(blocks):
                is_state = isinstance(self.specs[group_id], MambaSpec)
                assert block.is_null == (is_state and idx < len(blocks) - 1)
                if not block.is_null:
                    key = make_block_hash_with_group_id(request.block_hashes[idx], group_id)
                    assert block.block_hash == key

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.insert(0, request)

    def _finish(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        assert self.manager.get_block_ids(request.req_id) == tuple([] for _ in self.specs)

    def _snapshot(self) -> tuple[object, ...]:
        pool = self.manager.block_pool
        return (
            [block.ref_cnt for block in pool.blocks],
            [block.block_hash for block in pool.blocks],
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            {r.req_id: self.manager.get_block_ids(r.req_id) for r in self.running},
        )


class HybridMambaMachine(MambaKVCacheManagerMachine):
    specs = (FULL, ALIGN)
    can_drop_planned = False
    num_blocks = 28


class OneBlockMambaMachine(MambaKVCacheManagerMachine):
    specs = (ONE_BLOCK,)
    num_blocks = 6


class HybridOneBlockMambaMachine(MambaKVCacheManagerMachine):
    specs = (FULL, ONE_BLOCK)
    can_drop_planned = False
    num_blocks = 20


class HybridAlignWithoutCachingMachine(MambaKVCacheManagerMachine):
    specs = (FULL, ALIGN)
    enable_caching = False
    num_blocks = 20


STEP_SETTINGS = settings(stateful_step_count=30, deadline=None)
TestMambaMachine = MambaKVCacheManagerMachine.TestCase
TestHybridMambaMachine = HybridMambaMachine.TestCase
TestOneBlockMambaMachine = OneBlockMambaMachine.TestCase
TestHybridOneBlockMambaMachine = HybridOneBlockMambaMachine.TestCase
TestHybridAlignWithoutCachingMachine = HybridAlignWithoutCachingMachine.TestCase
for _case in (
    TestMambaMachine,
    TestHybridMambaMachine,
    TestOneBlockMambaMachine,
    TestHybridOneBlockMambaMachine,
    TestHybridAlignWithoutCachingMachine,
):
    _case.settings = STEP_SETTINGS
del _case  # a TestCase bound at module level would be collected once more
