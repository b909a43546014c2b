"""One Hypothesis state machine over KVCacheManager, parameterised by its groups' KV-cache specs
(full, sliding-window, chunked-local, R-SWA, cross attention and Mamba state, in any block sizes)
and by two policies (steps of one request or planned batches; a general-path twin or none),
against a dict-based model of the paged cache; test_kv_manager_machines.py holds the
subclasses. It owns no engine state and imports no torch.
"""

import math
from array import array

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
    cdiv,
)
from engine_core.sched.block_aligned_chunks import BlockAlignedChunks
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

# Specs whose hit length a brute-force search of the prefix cache gives exactly (see
# _brute_force_hit_length); for the others the hit is checked for soundness only.
BRUTE_FORCE_SPECS = (FullAttentionSpec, SlidingWindowSpec, CrossAttentionSpec, MambaSpec)


class Scheduled:
    """One request's work in a step: tokens [start, start + num_new), and whether the step admits
    it (the workers then run its encoder)."""

    def __init__(self, request: Request, start: int, num_new: int, is_admission: bool) -> None:
        self.request = request
        self.start = start
        self.num_new = num_new
        self.is_admission = is_admission


class KVCacheManagerModelMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes (and recurring encoder inputs), admissions that
    extend a running request, chunked prefill, decode, preemption when the pool runs out and at
    will, finish, finish-all and prefix-cache reset.

    A subclass names the specs, the pool size, the prompts and the policies. A stand-in for the
    workers writes what each computed token's K/V depends on into its slot, the prefix a Mamba
    state sums up into its state block, and a request's encoder input into its cross-attention
    blocks when it is admitted. Every token's attention reads, every state a step starts from,
    every prefix hit and every encoder read is checked against that memory, so a false hit, a
    wrong table, a lost checkpoint or a block reused while held fails the run. Requests hash at
    the gcd of the prefix-cached groups' block sizes.

    Policies:
    - `plans_batches` False: each `step` rule runs one request's next chunk at once, and a new
      request is admitted as it arrives (or waits). True: requests queue, and `plan_step` plans
      a step as the Scheduler does (running requests first, then admissions in order, head of
      line; computed tokens advance once the step is planned), then runs it as a batched kernel
      would: every request loads its starting state before any state is stored, so a checkpoint
      read in the step that writes it fails the run.
    - `checks_shortcuts`: a second manager with enable_shortcuts=False does every operation too;
      each lookup and allocation must return the same blocks and both pools hold the same state,
      so the manager's fast paths are proven equal to its general path.
    """

    specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    max_model_len = 40
    max_chunk_tokens = 7  # prefill chunk per step, so long prompts take several steps
    base_prompts: tuple[list[int], ...] = ([7] * 16, list(range(100, 116)), [1, 2] * 8)
    max_suffix_token = 3  # suffix tokens are 0..this, so suffixes recur
    max_suffix_len = 14
    encoder_inputs: tuple[tuple[int, ...], ...] = ()  # drawn per request when a group is cross
    caching_choices: tuple[bool, ...] = (True,)  # prefix caching, drawn once per run
    checks_shortcuts = False
    plans_batches = False
    # With plans_batches: whether a request allocated in a step may be preempted before the step
    # is planned, as the priority policy's victim can be. A state group takes back the
    # checkpoint such a request published; a full-attention group keeps the blocks it cached at
    # allocation, whose K/V are then never written, so machines with one (and a prefix cache)
    # do not drop.
    can_drop_planned = False

    def __init__(self) -> None:
        super().__init__()
        self.block_sizes = [spec.block_size for spec in self.specs]
        cached_sizes = [
            spec.block_size for spec in self.specs if not isinstance(spec, CrossAttentionSpec)
        ]
        self.hash_block_size = math.gcd(*cached_sizes)
        self.alignment = math.lcm(*cached_sizes)
        self.hasher = BlockHasher(self.hash_block_size)
        self.chunks = BlockAlignedChunks(self.alignment, self.max_chunk_tokens)
        self.enable_caching = True
        self.manager: KVCacheManager | None = None
        self.general: KVCacheManager | None = None  # the twin, when checks_shortcuts
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # new ones that did not fit (or queue), preempted ones
        self.num_requests = 0
        # The workers' paged cache, modelled. slots: block_id -> position in block -> what the
        # K/V written there depends on (slot_content), or ("enc", req_id, idx) in a
        # cross-attention block. states: block_id -> the slot_content of the last token a Mamba
        # state sums up. A block written as one kind stops holding the other.
        self.slots: dict[int, dict[int, object]] = {}
        self.states: dict[int, object] = {}
        self.prefixes: dict[str, list[tuple[int, ...]]] = {}  # see _prefix

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        self.enable_caching = data.draw(st.sampled_from(self.caching_choices), label="caching")
        groups = [KVCacheGroupSpec([f"g{idx}"], spec) for idx, spec in enumerate(self.specs)]
        config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=groups)
        self.manager = KVCacheManager(
            config, self.max_model_len, enable_caching=self.enable_caching
        )
        if self.checks_shortcuts:
            # The same operations through the general allocation path only: the definition
            # that each shortcut of the manager above must agree with on every step.
            self.general = KVCacheManager(
                config,
                self.max_model_len,
                enable_caching=self.enable_caching,
                enable_shortcuts=False,
            )

    @property
    def kv(self) -> KVCacheManager:
        assert self.manager is not None
        return self.manager

    def _managers(self) -> list[KVCacheManager]:
        return [self.kv] if self.general is None else [self.kv, self.general]

    @rule(data=st.data())
    def admit_new(self, data: st.DataObject) -> None:
        """A new request: admitted now, or queued for the next planned step."""
        base = data.draw(st.sampled_from(self.base_prompts))
        num_shared = data.draw(st.integers(0, len(base)))
        suffix_token = st.integers(0, self.max_suffix_token)
        suffix = data.draw(st.lists(suffix_token, min_size=1, max_size=self.max_suffix_len))
        encoder = None
        if self.encoder_inputs:
            encoder = array("i", data.draw(st.sampled_from(self.encoder_inputs)))
        self.num_requests += 1
        tokens = [*base[:num_shared], *suffix][: self.max_model_len - 4]
        request = Request(
            f"r{self.num_requests}",
            tokens,
            SamplingParams(),
            block_hasher=self.hasher,
            encoder_token_ids=encoder,
        )
        if self.plans_batches:
            self.waiting.append(request)
        else:
            self._admit_now(request)

    @precondition(lambda self: self.waiting and not self.plans_batches)
    @rule(data=st.data())
    def readmit_waiting(self, data: st.DataObject) -> None:
        self._admit_now(self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1))))

    @precondition(lambda self: self.running and not self.plans_batches)
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data: st.DataObject, num_steps: int) -> None:
        """Scheduling steps for one running request, each its next prefill chunk or one decode;
        several in a row reach past windows and chunks in fewer rules."""
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        for _ in range(num_steps):
            if request not in self.running:
                return  # finished or preempted
            if self._next_token(request, data):
                num_new = min(
                    request.num_tokens - request.num_computed_tokens, self.max_chunk_tokens
                )
                start = request.num_computed_tokens
                if self._allocate(request, num_new) is None:
                    self._preempt(request)
                else:
                    request.num_computed_tokens = start + num_new
                    self._execute([Scheduled(request, start, num_new, is_admission=False)])

    @precondition(lambda self: (self.running or self.waiting) and self.plans_batches)
    @rule(data=st.data(), is_aligned=st.booleans())
    def plan_step(self, data: st.DataObject, is_aligned: bool) -> None:
        """Plan one step (running requests first, then admissions in order), then run it.

        `is_aligned` picks the scheduler's block-aligned chunks or arbitrary ones: the cache
        must stay right either way; alignment only makes more checkpoints.
        """
        scheduled: list[Scheduled] = []
        for request in list(self.running):
            if not data.draw(st.booleans(), label=f"run {request.req_id}"):
                continue
            if not self._next_token(request, data):
                continue
            start = request.num_computed_tokens
            num_new = self._chunk(data, request, start, is_aligned)
            if num_new and self._allocate(request, num_new) is None:
                self._preempt(request)
            elif num_new:
                scheduled.append(Scheduled(request, start, num_new, is_admission=False))
        num_admissions = data.draw(st.integers(0, 3), label="admissions")
        while self.waiting and num_admissions:
            num_admissions -= 1
            admitted = self._admit_planned(data, self.waiting[0], is_aligned)
            if admitted is None:
                break  # head of line, as the scheduler admits
            scheduled.append(admitted)
        if self.can_drop_planned:
            for planned in list(scheduled):
                if data.draw(st.booleans(), label=f"drop {planned.request.req_id}"):
                    scheduled.remove(planned)  # preempted after its allocation: never runs
                    self._preempt(planned.request)
        for planned in scheduled:  # the step is planned
            planned.request.num_computed_tokens = planned.start + planned.num_new
        self._execute(scheduled)

    @precondition(lambda self: self.running and not self.plans_batches)
    @rule(data=st.data())
    def admit_extension(self, data: st.DataObject) -> None:
        """Admit a prompt that is another request's tokens so far, generated ones included: its
        prompt blocks then cache what the other request computed as generated tokens."""
        other = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if other.num_tokens >= self.max_model_len - 4:
            return
        self.num_requests += 1
        tokens = [*other.all_token_ids, data.draw(st.integers(0, self.max_suffix_token))]
        request = Request(
            f"r{self.num_requests}",
            tokens,
            SamplingParams(),
            block_hasher=self.hasher,
            encoder_token_ids=other.encoder_token_ids,
        )
        self._admit_now(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Preempt a request at will, so resumed requests with generated tokens look up hits."""
        self._preempt(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @rule()
    def finish_all(self) -> None:
        """No leak: once every request is gone, every usable block is free again."""
        for request in list(self.running):
            self._finish(request)
        for manager in self._managers():
            manager.check_invariants()
            assert manager.block_pool.get_num_free_blocks() == self.num_blocks - 1, "a leak"
            assert manager.usage == 0.0

    @rule()
    def reset_prefix_cache(self) -> None:
        for manager in self._managers():
            assert manager.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self) -> None:
        """Manager invariants; the twin in the same state; tables match the model; ref counts
        match the tables."""
        if self.manager is None:
            return
        for manager in self._managers():
            manager.check_invariants()
        if self.general is not None:
            assert self._snapshot(self.kv) == self._snapshot(self.general), (
                "the shortcuts left another pool state than the general path"
            )
            assert self.kv.make_prefix_cache_stats() == self.general.make_prefix_cache_stats()
        blocks = self.kv.block_pool.blocks
        owner: dict[int, int] = {}  # block id -> the group whose table lists it
        num_refs = [0] * self.num_blocks
        for request in self.running:
            tables = self.kv.get_block_ids(request.req_id)
            for group_id, table in enumerate(tables):
                spec, size = self.specs[group_id], self.block_sizes[group_id]
                if isinstance(spec, CrossAttentionSpec):
                    self._check_encoder_blocks(request, table, size)
                else:
                    expected = cdiv(request.num_computed_tokens, size)
                    if isinstance(spec, MambaSpec) and not self._keeps_checkpoints(spec):
                        expected = 1
                    assert len(table) == expected, f"{request!r} holds {table} in group {group_id}"
                for block_id in table:
                    if block_id:
                        num_refs[block_id] += 1
                        assert owner.setdefault(block_id, group_id) == group_id, (
                            f"block {block_id} is in groups {owner[block_id]} and {group_id}"
                        )
        for block in blocks[1:]:
            assert block.ref_cnt == num_refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, {num_refs[block.block_id]} "
                f"tables list it"
            )
            # Two requests share a block only through a hit, so a shared block is a cached one.
            assert num_refs[block.block_id] <= 1 or block.block_hash is not None, (
                f"block {block.block_id} is held by {num_refs[block.block_id]} requests unhashed"
            )
        for request in self.waiting:
            assert self.kv.get_block_ids(request.req_id) == tuple([] for _ in self.specs)

    def teardown(self) -> None:
        if self.manager is not None:
            self.finish_all()
            self.consistent()

    # What a token's K/V depends on, and which positions its attention reads, per spec.

    def slot_content(self, request: Request, spec: KVCacheSpec, pos: int) -> object:
        """What the K/V of token `pos` (or a state after it) depends on: its prefix and the
        encoder input; under R-SWA also whether it is a prompt token (a generated token saw
        only a window)."""
        encoder = None if request.encoder_token_ids is None else tuple(request.encoder_token_ids)
        is_prompt = isinstance(spec, RSWASpec) and pos < request.num_prompt_tokens
        return (self._prefix(request, pos), encoder, is_prompt)

    def _prefix(self, request: Request, pos: int) -> tuple[int, ...]:
        """tuple(request.all_token_ids[: pos + 1]), built once per request and position: a
        request's tokens are only ever appended to."""
        prefixes = self.prefixes.setdefault(request.req_id, [])
        tokens = request.all_token_ids
        while len(prefixes) <= pos:
            prefixes.append(tuple(tokens[: len(prefixes) + 1]))
        return prefixes[pos]

    @staticmethod
    def read_positions(request: Request, spec: KVCacheSpec, pos: int) -> list[int]:
        """The positions whose K/V the query at `pos` reads in a group of this spec."""
        match spec:
            case SlidingWindowSpec(sliding_window=window):
                return list(range(max(pos - window + 1, 0), pos + 1))
            case ChunkedLocalAttentionSpec(attention_chunk_size=chunk_size):
                return list(range(pos // chunk_size * chunk_size, pos + 1))
            case RSWASpec(rswa_window=window):
                num_prompt = request.num_prompt_tokens
                window_start = max(num_prompt, pos - window)
                return [*range(min(num_prompt, pos + 1)), *range(window_start, pos + 1)]
            case _:
                return list(range(pos + 1))

    def _keeps_checkpoints(self, spec: MambaSpec) -> bool:
        """Align mode with a prefix cache keeps a state per block; otherwise one state block."""
        return self.enable_caching and spec.mamba_cache_mode == "align"

    def _state_idx(self, spec: MambaSpec, num_tokens: int) -> int:
        """Where the state after `num_tokens` tokens lives in a table of this spec."""
        size = spec.block_size
        return cdiv(num_tokens, size) - 1 if self._keeps_checkpoints(spec) else 0

    # The scheduler's part: admit, allocate, preempt, finish.

    def max_hit_length(self, request: Request) -> int:
        """The last token is always computed; under R-SWA a hit also stops at the prompt."""
        if any(isinstance(spec, RSWASpec) for spec in self.specs):
            return min(request.num_tokens - 1, request.num_prompt_tokens)
        return request.num_tokens - 1

    def _next_token(self, request: Request, data: st.DataObject) -> bool:
        """Before a running request's step: a decode appends a sampled token, and a request at
        the length cap finishes (False)."""
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= self.max_model_len:
                self._finish(request)
                return False
            request.append_output_token_ids(data.draw(st.integers(0, self.max_suffix_token)))
        return True

    def _chunk(self, data: st.DataObject, request: Request, start: int, is_aligned: bool) -> int:
        drawn = data.draw(st.integers(1, self.max_chunk_tokens))
        num_new = min(request.num_tokens - start, drawn)
        keeps_checkpoints = any(
            isinstance(spec, MambaSpec) and self._keeps_checkpoints(spec) for spec in self.specs
        )
        if is_aligned and keeps_checkpoints:
            return self.chunks.clip(request, start, num_new)
        return num_new

    def _lookup(self, request: Request) -> tuple[KVCacheBlocks, int, KVCacheBlocks | None]:
        """get_computed_blocks, checked: the hit is the brute-force one where that is exact,
        sound always, and the twin's the same."""
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if all(isinstance(spec, BRUTE_FORCE_SPECS) for spec in self.specs):
            expected = self._brute_force_hit_length(request)
            assert num_hit_tokens == expected, (
                f"{request.req_id} hits {num_hit_tokens}, not {expected}"
            )
        general_hits = None
        if self.general is not None:
            general_hits, num_general_hit_tokens = self.general.get_computed_blocks(request)
            assert (hits.get_block_ids(), num_hit_tokens, hits.shared_prefix_boundary) == (
                general_hits.get_block_ids(),
                num_general_hit_tokens,
                general_hits.shared_prefix_boundary,
            )
        return hits, num_hit_tokens, general_hits

    def _admit_now(self, request: Request) -> None:
        """Admit and run the first chunk at once, or wait."""
        hits, num_hit_tokens, general_hits = self._lookup(request)
        # Nothing else runs before this request's chunk, so its hits' contents are final now.
        self._check_hits(request, hits, num_hit_tokens, check_contents=True)
        num_new = min(request.num_tokens - num_hit_tokens, self.max_chunk_tokens)
        if self._allocate(request, num_new, num_hit_tokens, hits, general_hits) is None:
            self.waiting.append(request)  # waits, as the scheduler would keep it waiting
            return
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_new
        self.running.append(request)
        self._execute([Scheduled(request, num_hit_tokens, num_new, is_admission=True)])

    def _admit_planned(
        self, data: st.DataObject, request: Request, is_aligned: bool
    ) -> Scheduled | None:
        """Admit the head of the queue into the step being planned, or None if it does not fit.
        Its hits' contents may be written later in this very step: the reads check them."""
        hits, num_hit_tokens, general_hits = self._lookup(request)
        self._check_hits(request, hits, num_hit_tokens, check_contents=False)
        num_new = self._chunk(data, request, num_hit_tokens, is_aligned)
        if not num_new:
            return None
        if self._allocate(request, num_new, num_hit_tokens, hits, general_hits) is None:
            return None
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens  # as the scheduler sets it at admission
        self.running.append(request)
        return Scheduled(request, num_hit_tokens, num_new, is_admission=True)

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hits: KVCacheBlocks | None = None,
        general_hits: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """allocate_slots on the manager (and its twin, given its own `general_hits`).

        A failed allocate_slots must leave the pool and every table as they were.
        """
        before = self._snapshot(self.kv)
        num_encoder_tokens = request.num_encoder_tokens if hits is not None else 0
        new_blocks = self.kv.allocate_slots(
            request, num_new_tokens, num_hit_tokens, hits, num_encoder_tokens=num_encoder_tokens
        )
        if self.general is not None:
            general_blocks = self.general.allocate_slots(
                request,
                num_new_tokens,
                num_hit_tokens,
                general_hits,
                num_encoder_tokens=num_encoder_tokens,
            )
            assert (new_blocks is None) == (general_blocks is None), (
                f"{request.req_id}: the shortcuts returned {new_blocks}, the general path "
                f"{general_blocks}"
            )
            if new_blocks is not None and general_blocks is not None:
                assert new_blocks.get_block_ids() == general_blocks.get_block_ids()
                assert (new_blocks is self.kv.empty_kv_cache_blocks) == (
                    general_blocks is self.general.empty_kv_cache_blocks
                )
        if new_blocks is None:
            assert self._snapshot(self.kv) == before, "a failed allocate_slots changed the pool"
        return new_blocks

    def _preempt(self, request: Request) -> None:
        for manager in self._managers():
            manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        # Recomputed from scratch when readmitted; a planned queue resumes it first.
        if self.plans_batches:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def _finish(self, request: Request) -> None:
        for manager in self._managers():
            manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        assert self.kv.get_block_ids(request.req_id) == tuple([] for _ in self.specs)

    # The workers' part: run a step against the modelled cache.

    def before_writes(self, scheduled: list[Scheduled]) -> None:
        """Between a step's allocations and the workers' writes of its tokens: a subclass runs
        what the workers do first there (the tier machine, a step's copies)."""

    def _execute(self, scheduled: list[Scheduled]) -> None:
        """Load every starting state, then store encoder outputs, K/V and states, then read."""
        self.before_writes(scheduled)
        tables = {
            planned.request.req_id: self.kv.get_block_ids(planned.request.req_id)
            for planned in scheduled
        }
        for planned in scheduled:
            request, start = planned.request, planned.start
            for group_id, spec in enumerate(self.specs):
                if isinstance(spec, MambaSpec) and start:
                    block_id = tables[request.req_id][group_id][self._state_idx(spec, start)]
                    self._check_state(request, spec, block_id, start)
        for planned in scheduled:
            request, start, end = planned.request, planned.start, planned.start + planned.num_new
            table = tables[request.req_id]
            if planned.is_admission:
                self._write_encoder(request, table)  # the workers run the encoder on admission
            for group_id, spec in enumerate(self.specs):
                size = self.block_sizes[group_id]
                if isinstance(spec, MambaSpec):
                    block_id = table[group_id][self._state_idx(spec, end)]
                    assert block_id, f"{request.req_id} stores its state in the null block"
                    self.slots.pop(block_id, None)
                    self.states[block_id] = self.slot_content(request, spec, end - 1)
                    continue
                if isinstance(spec, CrossAttentionSpec):
                    continue
                for pos in range(start, end):
                    block_id = table[group_id][pos // size]
                    assert block_id, f"{request.req_id} writes token {pos} into the null block"
                    self.states.pop(block_id, None)
                    self.slots.setdefault(block_id, {})[pos % size] = self.slot_content(
                        request, spec, pos
                    )
        for planned in scheduled:
            request = planned.request
            for group_id, spec in enumerate(self.specs):
                if isinstance(spec, MambaSpec | CrossAttentionSpec):
                    continue
                table = tables[request.req_id][group_id]
                for pos in range(planned.start, planned.start + planned.num_new):
                    self._check_attention_reads(request, table, pos, group_id)

    def _write_encoder(self, request: Request, tables: tuple[list[int], ...]) -> None:
        for group_id, table in enumerate(tables):
            size = self.block_sizes[group_id]
            if isinstance(self.specs[group_id], CrossAttentionSpec):
                for idx in range(request.num_encoder_tokens):
                    self.states.pop(table[idx // size], None)
                    self.slots.setdefault(table[idx // size], {})[idx % size] = (
                        "enc",
                        request.req_id,
                        idx,
                    )

    # Checks against the modelled cache.

    def _check_state(self, request: Request, spec: MambaSpec, block_id: int, start: int) -> None:
        """A step resumes from the state after exactly its computed tokens."""
        found = self.states.get(block_id)
        expected = self.slot_content(request, spec, start - 1)
        assert block_id and found == expected, (
            f"{request.req_id} starts from block {block_id} holding {found}, expected the "
            f"state after {expected}"
        )

    def _check_encoder_blocks(self, request: Request, table: list[int], size: int) -> None:
        """A running request reads its own encoder output from its own unshared blocks."""
        assert len(table) == cdiv(request.num_encoder_tokens, size), (
            f"{request.req_id} holds {len(table)} encoder blocks for "
            f"{request.num_encoder_tokens} encoder tokens"
        )
        blocks = self.kv.block_pool.blocks
        for idx in range(request.num_encoder_tokens):
            block_id = table[idx // size]
            assert blocks[block_id].ref_cnt == 1, f"encoder block {block_id} is shared"
            assert blocks[block_id].block_hash is None, f"encoder block {block_id} is hashed"
            content = self.slots[block_id][idx % size]
            assert content == ("enc", request.req_id, idx), (
                f"{request.req_id} reads {content} at encoder position {idx}"
            )

    def _check_attention_reads(
        self, request: Request, table: list[int], pos: int, group_id: int
    ) -> None:
        """Token `pos` reads the tokens its attention spans: each must sit in its real slot."""
        spec, size = self.specs[group_id], self.block_sizes[group_id]
        for read_pos in self.read_positions(request, spec, pos):
            block_id = table[read_pos // size]
            found = self.slots.get(block_id, {}).get(read_pos % size)
            expected = self.slot_content(request, spec, read_pos)
            assert block_id != 0 and found == expected, (
                f"{request.req_id} token {pos} reads token {read_pos} from block {block_id} "
                f"of group {group_id}: found {found}, expected {expected}"
            )

    def _check_hits(
        self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int, check_contents: bool
    ) -> None:
        """A hit is sound: each real hit block carries the right key (and, `check_contents`,
        holds the right K/V); a null block stands only where the next token reads nothing, and
        a state group's hit is its one block at the end."""
        assert num_hit_tokens % self.alignment == 0, (num_hit_tokens, self.alignment)
        assert num_hit_tokens <= self.max_hit_length(request), (request, num_hit_tokens)
        for group_id, blocks in enumerate(hits.blocks):
            spec, size = self.specs[group_id], self.block_sizes[group_id]
            if isinstance(spec, CrossAttentionSpec):
                assert not blocks, "a cross-attention block was offered as a hit"
                continue
            assert len(blocks) == num_hit_tokens // size
            if isinstance(spec, MambaSpec):
                assert not num_hit_tokens or self._keeps_checkpoints(spec), (
                    f"a hit of {num_hit_tokens} tokens without align mode and a prefix cache"
                )
                for idx, block in enumerate(blocks):
                    assert block.is_null == (idx < len(blocks) - 1), f"state hit {idx} of {blocks}"
                    if not block.is_null:
                        assert block.block_hash == self._key(request, group_id, idx)
                continue  # the step that resumes from it checks the state
            read_from = min(self.read_positions(request, spec, num_hit_tokens))
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert not isinstance(spec, FullAttentionSpec)
                    assert (idx + 1) * size <= read_from, f"null hit {idx} is still read"
                    continue
                assert block.block_hash == self._key(request, group_id, idx)
                if not check_contents:
                    continue
                positions = range(idx * size, (idx + 1) * size)
                expected = {pos % size: self.slot_content(request, spec, pos) for pos in positions}
                # A block id serves one group at a time, but may have served a larger one before.
                held = {i: c for i, c in self.slots[block.block_id].items() if i < size}
                assert held == expected, (
                    f"false hit: block {block.block_id} holds {held}, "
                    f"{request.req_id} expects {expected}"
                )

    def _key(self, request: Request, group_id: int, idx: int) -> bytes:
        """Group `group_id`'s prefix-cache key for block `idx`: its last hash block's hash."""
        scale = self.block_sizes[group_id] // self.hash_block_size
        return make_block_hash_with_group_id(request.block_hashes[(idx + 1) * scale - 1], group_id)

    def _is_cached(self, request: Request, group_id: int, idx: int) -> bool:
        key = self._key(request, group_id, idx)
        return self.kv.block_pool.cached_block_hash_to_block.get_one_block(key) is not None

    def _brute_force_hit_length(self, request: Request) -> int:
        """The longest aligned length below num_tokens that every group can serve from cache."""
        num_hashed_tokens = len(request.block_hashes) * self.hash_block_size
        longest = min(request.num_tokens - 1, num_hashed_tokens)
        for length in range(longest // self.alignment * self.alignment, 0, -self.alignment):
            if all(self._group_serves(request, g, length) for g in range(len(self.specs))):
                return length
        return 0

    def _group_serves(self, request: Request, group_id: int, length: int) -> bool:
        spec, size = self.specs[group_id], self.block_sizes[group_id]
        if isinstance(spec, CrossAttentionSpec):
            return True  # it holds the encoder's output, recomputed at every admission
        num_blocks = length // size
        if isinstance(spec, MambaSpec):  # the state at the end of the hit, in its last block
            is_align = spec.mamba_cache_mode == "align"
            return is_align and self._is_cached(request, group_id, num_blocks - 1)
        first_needed = 0
        if isinstance(spec, SlidingWindowSpec):
            first_needed = max(num_blocks - cdiv(spec.sliding_window - 1, size), 0)
        return all(self._is_cached(request, group_id, i) for i in range(first_needed, num_blocks))

    def _snapshot(self, manager: KVCacheManager) -> tuple[object, ...]:
        """The pool's ref counts, hashes and free-queue order, and every request's tables."""
        pool = manager.block_pool
        return (
            [block.ref_cnt for block in pool.blocks],
            [block.block_hash for block in pool.blocks],
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            {r.req_id: manager.get_block_ids(r.req_id) for r in [*self.running, *self.waiting]},
        )
