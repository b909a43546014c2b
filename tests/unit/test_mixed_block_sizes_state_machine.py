"""A Hypothesis state machine over KVCacheManager whose groups differ in block size.

Requests hash at the gcd of the block sizes. A stand-in for the workers writes each computed
token into its slot, so every hit is checked against the tokens its blocks hold; every hit length
must equal a brute-force search of the prefix cache, and no block may serve two groups at once.
"""

import math

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_specs import full_spec, window_spec

from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

MAX_MODEL_LEN = 40
MAX_CHUNK_TOKENS = 7  # prefill chunk per step, so long prompts take several steps
BASE_PROMPTS = ([7] * 16, list(range(100, 116)), [1, 2] * 8)  # prefixes requests share


class MixedBlockSizesMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes, chunked prefill, decode, preemption, free, reset."""

    specs: tuple[KVCacheSpec, ...] = (full_spec(2), window_spec(5, 4))
    num_blocks = 40

    def __init__(self) -> None:
        super().__init__()
        groups = [KVCacheGroupSpec(layer_names=[f"g{i}"], spec=s) for i, s in enumerate(self.specs)]
        config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=groups)
        self.manager = KVCacheManager(config, MAX_MODEL_LEN)
        self.block_sizes = [spec.block_size for spec in self.specs]
        self.hash_block_size = math.gcd(*self.block_sizes)
        self.alignment = math.lcm(*self.block_sizes)
        self.hasher = BlockHasher(self.hash_block_size)
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.num_requests = 0
        # block_id -> position in block -> the token written there: the workers' cache, modelled
        self.slots: dict[int, dict[int, int]] = {}

    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        num_shared=st.integers(0, 16),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=14),
    )
    def admit_new(self, base: list[int], num_shared: int, suffix: list[int]) -> None:
        self.num_requests += 1
        tokens = [*base[:num_shared], *suffix][: MAX_MODEL_LEN - 4]
        request = Request(
            f"r{self.num_requests}", tokens, SamplingParams(), block_hasher=self.hasher
        )
        self._admit(request)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit_waiting(self, data: st.DataObject) -> None:
        self._admit(self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduling step for one running request: its next prefill chunk, or one decode."""
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                self._finish(request)
                return
            request.append_output_token_ids(data.draw(st.integers(0, 3)))
        num_new = min(request.num_tokens - request.num_computed_tokens, MAX_CHUNK_TOKENS)
        if self._allocate(request, num_new) is None:
            self._preempt(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        owner: dict[int, int] = {}  # block id -> the group whose table lists it
        for request in self.running:
            tables = self.manager.get_block_ids(request.req_id)
            for group_id, (table, size) in enumerate(zip(tables, self.block_sizes, strict=True)):
                assert len(table) == cdiv(request.num_computed_tokens, size), (request, table)
                for block_id in table:
                    if block_id:
                        assert owner.setdefault(block_id, group_id) == group_id, (
                            f"block {block_id} is in groups {owner[block_id]} and {group_id}"
                        )

    def teardown(self) -> None:
        for request in list(self.running):
            self._finish(request)
        self.manager.check_invariants()
        assert self.manager.block_pool.get_num_free_blocks() == self.num_blocks - 1

    def _admit(self, request: Request) -> None:
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens == self._brute_force_hit_length(request), request
        self._check_hits(request, hits, num_hit_tokens)
        num_new = min(request.num_tokens - num_hit_tokens, MAX_CHUNK_TOKENS)
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
        """allocate_slots, then the workers' part: write the computed tokens into their slots."""
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new_blocks is None:
            return None
        start = request.num_computed_tokens + num_hit_tokens
        tables = self.manager.get_block_ids(request.req_id)
        for pos in range(start, start + num_new_tokens):
            for group_id, table in enumerate(tables):
                size = self.block_sizes[group_id]
                block_id = table[pos // size]
                assert block_id != 0, f"{request!r} writes token {pos} into the null block"
                self.slots.setdefault(block_id, {})[pos % size] = request.all_token_ids[pos]
                self._check_attention_reads(request, table, pos, group_id)
        request.num_computed_tokens = start + num_new_tokens
        return new_blocks

    def _check_attention_reads(
        self, request: Request, table: list[int], pos: int, group_id: int
    ) -> None:
        """Token `pos` reads the tokens its attention spans: each must sit in its real slot."""
        spec, size = self.specs[group_id], self.block_sizes[group_id]
        first_read = 0
        if isinstance(spec, SlidingWindowSpec):
            first_read = max(pos - spec.sliding_window + 1, 0)
        for read_pos in range(first_read, pos + 1):
            block_id = table[read_pos // size]
            found = self.slots.get(block_id, {}).get(read_pos % size)
            assert block_id != 0 and found == request.all_token_ids[read_pos], (
                f"{request.req_id} token {pos} reads token {read_pos} from block {block_id} "
                f"of group {group_id}: found {found}, expected {request.all_token_ids[read_pos]}"
            )

    def _key(self, request: Request, group_id: int, idx: int) -> bytes:
        """Group `group_id`'s prefix-cache key for block `idx`: its last hash block's hash."""
        scale = self.block_sizes[group_id] // self.hash_block_size
        return make_block_hash_with_group_id(request.block_hashes[(idx + 1) * scale - 1], group_id)

    def _is_cached(self, request: Request, group_id: int, idx: int) -> bool:
        key = self._key(request, group_id, idx)
        return self.manager.block_pool.cached_block_hash_to_block.get_one_block(key) is not None

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
        num_blocks = length // size
        first_needed = 0
        if isinstance(spec, SlidingWindowSpec):
            first_needed = max(num_blocks - cdiv(spec.sliding_window - 1, size), 0)
        else:
            assert isinstance(spec, FullAttentionSpec)
        return all(self._is_cached(request, group_id, i) for i in range(first_needed, num_blocks))

    def _check_hits(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """A hit is sound: each real hit block carries the right key and holds the right tokens."""
        assert num_hit_tokens % self.alignment == 0 and num_hit_tokens < request.num_tokens
        tokens = request.all_token_ids
        for group_id, blocks in enumerate(hits.blocks):
            size = self.block_sizes[group_id]
            assert len(blocks) == num_hit_tokens // size
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert isinstance(self.specs[group_id], SlidingWindowSpec)
                    continue
                assert block.block_hash == self._key(request, group_id, idx)
                expected = dict(enumerate(tokens[idx * size : (idx + 1) * size]))
                # A block id serves one group at a time, but may have served a larger one before.
                held = {i: t for i, t in self.slots[block.block_id].items() if i < size}
                assert held == expected, (
                    f"false hit: block {block.block_id} holds {held}, "
                    f"{request.req_id} expects {expected}"
                )

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def _finish(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        assert self.manager.get_block_ids(request.req_id) == tuple([] for _ in self.specs)


class LargerFullBlocksMachine(MixedBlockSizesMachine):
    """Full attention in the larger blocks: it reads the view, the window the plain hashes."""

    specs = (full_spec(4), window_spec(3, 2))


class ThreeSizesMachine(MixedBlockSizesMachine):
    """Block sizes 2, 4 and 6: hashes at 2, hits on multiples of 12."""

    specs = (full_spec(2), window_spec(5, 4), window_spec(7, 6))
    num_blocks = 60


STEP_SETTINGS = settings(stateful_step_count=40, deadline=None)
TestMixedBlockSizesMachine = MixedBlockSizesMachine.TestCase
TestMixedBlockSizesMachine.settings = STEP_SETTINGS
TestLargerFullBlocksMachine = LargerFullBlocksMachine.TestCase
TestLargerFullBlocksMachine.settings = STEP_SETTINGS
TestThreeSizesMachine = ThreeSizesMachine.TestCase
TestThreeSizesMachine.settings = STEP_SETTINGS
