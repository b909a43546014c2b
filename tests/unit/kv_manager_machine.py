"""One Hypothesis state machine over KVCacheManager, parameterised by its groups' KV-cache specs
(full, sliding-window, chunked-local, R-SWA and cross attention, in any block sizes), against a
dict-based model of the paged cache; test_kv_manager_machines.py holds the subclasses. It owns no
engine state and imports no torch.
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
    RSWASpec,
    SlidingWindowSpec,
    cdiv,
)
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

# Specs whose hit length a brute-force search of the prefix cache gives exactly (see
# _brute_force_hit_length); for the others the hit is checked for soundness only.
BRUTE_FORCE_SPECS = (FullAttentionSpec, SlidingWindowSpec, CrossAttentionSpec)


class KVCacheManagerModelMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes (and recurring encoder inputs), admissions that
    extend a running request, chunked prefill, decode, preemption when the pool runs out and at
    will, finish, finish-all and prefix-cache reset.

    A subclass names the specs, the pool size and the prompts. A stand-in for the workers writes
    what each computed token's K/V depends on into its slot, and a request's encoder input into
    its cross-attention blocks when it is admitted. Every token's attention reads, every prefix
    hit and every encoder read is checked against those slots, so a false hit, a wrong table or
    a block reused while held fails the run. Requests hash at the gcd of the prefix-cached
    groups' block sizes.

    test_kv_cache_manager_state_machine.py's one-group and full-plus-window machines are this
    machine with specs (full_spec(),) and (full_spec(), window_spec(5)); its fast-versus-general
    allocation check would be one more rule here.
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

    def __init__(self) -> None:
        super().__init__()
        self.block_sizes = [spec.block_size for spec in self.specs]
        cached_sizes = [
            spec.block_size for spec in self.specs if not isinstance(spec, CrossAttentionSpec)
        ]
        self.hash_block_size = math.gcd(*cached_sizes)
        self.alignment = math.lcm(*cached_sizes)
        self.hasher = BlockHasher(self.hash_block_size)
        self.manager: KVCacheManager | None = None
        self.running: list[Request] = []
        self.waiting: list[Request] = []  # new ones that did not fit, and preempted ones
        self.num_requests = 0
        # block_id -> position in block -> what the K/V written there depends on (slot_content),
        # or ("enc", req_id, idx) in a cross-attention block: the workers' paged cache, modelled
        self.slots: dict[int, dict[int, object]] = {}

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        enable_caching = data.draw(st.sampled_from(self.caching_choices), label="enable_caching")
        groups = [KVCacheGroupSpec([f"g{idx}"], spec) for idx, spec in enumerate(self.specs)]
        config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=groups)
        self.manager = KVCacheManager(config, self.max_model_len, enable_caching=enable_caching)

    @property
    def kv(self) -> KVCacheManager:
        assert self.manager is not None
        return self.manager

    @rule(data=st.data())
    def admit_new(self, data: st.DataObject) -> None:
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
        self._admit(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit_waiting(self, data: st.DataObject) -> None:
        self._admit(self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1))))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data: st.DataObject, num_steps: int) -> None:
        """Scheduling steps for one running request, each its next prefill chunk or one decode;
        several in a row reach past windows and chunks in fewer rules."""
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        for _ in range(num_steps):
            if request not in self.running:
                return  # finished or preempted
            self._step(request, data)

    def _step(self, request: Request, data: st.DataObject) -> None:
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= self.max_model_len:
                self._finish(request)
                return
            request.append_output_token_ids(data.draw(st.integers(0, self.max_suffix_token)))
        num_new = min(request.num_tokens - request.num_computed_tokens, self.max_chunk_tokens)
        if self._allocate(request, num_new) is None:
            self._preempt(request)

    @precondition(lambda self: self.running)
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
        self._admit(request)

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
        self.kv.check_invariants()
        assert self.kv.block_pool.get_num_free_blocks() == self.num_blocks - 1, "a block leaked"
        assert self.kv.usage == 0.0

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.kv.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self) -> None:
        """Manager invariants; tables match the model; ref counts match the tables."""
        if self.manager is None:
            return
        self.kv.check_invariants()
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
                    assert len(table) == cdiv(request.num_computed_tokens, size), (
                        f"{request!r} holds {table} in group {group_id}"
                    )
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

    # What a token's K/V depends on, and which positions its attention reads, per spec.

    def slot_content(self, request: Request, spec: KVCacheSpec, pos: int) -> object:
        """What the K/V of token `pos` depends on: its prefix and the encoder input; under
        R-SWA also whether it is a prompt token (a generated token saw only a window)."""
        encoder = None if request.encoder_token_ids is None else tuple(request.encoder_token_ids)
        is_prompt = isinstance(spec, RSWASpec) and pos < request.num_prompt_tokens
        return (tuple(request.all_token_ids[: pos + 1]), encoder, is_prompt)

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

    # The scheduler's part: admit, allocate, preempt, finish.

    def max_hit_length(self, request: Request) -> int:
        """The last token is always computed; under R-SWA a hit also stops at the prompt."""
        if any(isinstance(spec, RSWASpec) for spec in self.specs):
            return min(request.num_tokens - 1, request.num_prompt_tokens)
        return request.num_tokens - 1

    def _admit(self, request: Request) -> None:
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        if all(isinstance(spec, BRUTE_FORCE_SPECS) for spec in self.specs):
            assert num_hit_tokens == self._brute_force_hit_length(request), request
        self._check_hits(request, hits, num_hit_tokens)
        num_new = min(request.num_tokens - num_hit_tokens, self.max_chunk_tokens)
        if self._allocate(request, num_new, num_hit_tokens, hits) is None:
            self.waiting.append(request)  # waits, as the scheduler would keep it waiting
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hits: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """allocate_slots, then the workers' part: write the computed tokens into their slots.

        A failed allocate_slots must leave the pool and every table as they were.
        """
        is_admission = hits is not None
        before = self._snapshot()
        num_encoder_tokens = request.num_encoder_tokens if is_admission else 0
        new_blocks = self.kv.allocate_slots(
            request, num_new_tokens, num_hit_tokens, hits, num_encoder_tokens=num_encoder_tokens
        )
        if new_blocks is None:
            assert self._snapshot() == before, "a failed allocate_slots changed the pool"
            return None
        self.before_writes(request, num_new_tokens + num_hit_tokens)
        tables = self.kv.get_block_ids(request.req_id)
        if is_admission:
            self._write_encoder(request, tables)  # the workers run the encoder on admission
        start = request.num_computed_tokens + num_hit_tokens
        for pos in range(start, start + num_new_tokens):
            for group_id, table in enumerate(tables):
                spec, size = self.specs[group_id], self.block_sizes[group_id]
                if isinstance(spec, CrossAttentionSpec):
                    continue
                block_id = table[pos // size]
                assert block_id != 0, f"{request!r} writes token {pos} into the null block"
                self.slots.setdefault(block_id, {})[pos % size] = self.slot_content(
                    request, spec, pos
                )
                self._check_attention_reads(request, table, pos, group_id)
        request.num_computed_tokens = start + num_new_tokens
        return new_blocks

    def before_writes(self, request: Request, num_new_tokens: int) -> None:
        """Between an allocation and the workers' writes of its tokens: a subclass runs what
        the workers do first there (the tier machine, a step's copies)."""

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)  # recomputed from scratch when readmitted

    def _finish(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        assert self.kv.get_block_ids(request.req_id) == tuple([] for _ in self.specs)

    # Checks against the modelled cache.

    def _write_encoder(self, request: Request, tables: tuple[list[int], ...]) -> None:
        for group_id, table in enumerate(tables):
            size = self.block_sizes[group_id]
            if isinstance(self.specs[group_id], CrossAttentionSpec):
                for idx in range(request.num_encoder_tokens):
                    self.slots.setdefault(table[idx // size], {})[idx % size] = (
                        "enc",
                        request.req_id,
                        idx,
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

    def _check_hits(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """A hit is sound: each real hit block carries the right key and holds the right K/V;
        a null block stands only where the next token reads nothing."""
        assert num_hit_tokens % self.alignment == 0, (num_hit_tokens, self.alignment)
        assert num_hit_tokens <= self.max_hit_length(request), (request, num_hit_tokens)
        for group_id, blocks in enumerate(hits.blocks):
            spec, size = self.specs[group_id], self.block_sizes[group_id]
            if isinstance(spec, CrossAttentionSpec):
                assert not blocks, "a cross-attention block was offered as a hit"
                continue
            assert len(blocks) == num_hit_tokens // size
            read_from = min(self.read_positions(request, spec, num_hit_tokens))
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert not isinstance(spec, FullAttentionSpec)
                    assert (idx + 1) * size <= read_from, f"null hit {idx} is still read"
                    continue
                assert block.block_hash == self._key(request, group_id, idx)
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
        first_needed = 0
        if isinstance(spec, SlidingWindowSpec):
            first_needed = max(num_blocks - cdiv(spec.sliding_window - 1, size), 0)
        return all(self._is_cached(request, group_id, i) for i in range(first_needed, num_blocks))

    def _snapshot(self) -> tuple[object, ...]:
        pool = self.kv.block_pool
        return (
            [block.ref_cnt for block in pool.blocks],
            [block.block_hash for block in pool.blocks],
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            {r.req_id: self.kv.get_block_ids(r.req_id) for r in self.running},
        )
