"""A Hypothesis state machine over KVCacheManager, for one group and for hybrid models.

A stand-in for the workers writes each computed token into its slot of a dict-based copy of the
paged cache, so every prefix hit is checked against the tokens its blocks really hold. A second
manager with its allocation shortcuts turned off runs every operation too: each lookup and
allocation must return the same block ids, and both pools must hold the same state.
"""

from array import array

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
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

BLOCK_SIZE = 2
MAX_MODEL_LEN = 32
MAX_CHUNK_TOKENS = 7  # prefill chunk per step, so long prompts take several steps
BASE_PROMPTS = ([7] * 12, list(range(100, 112)), [1, 2] * 6)  # prefixes requests share
FULL = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")
WINDOW = SlidingWindowSpec(
    block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", sliding_window=5
)
CHUNKED_LOCAL = ChunkedLocalAttentionSpec(
    block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", attention_chunk_size=4
)
RSWA = RSWASpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=3)
SKIPS_LEADING_BLOCKS = (SlidingWindowSpec, ChunkedLocalAttentionSpec)  # hits may start with nulls


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes, chunked prefill, decode, preemption, free, reset."""

    specs: tuple[KVCacheSpec, ...] = (FULL,)
    num_blocks = 20

    def __init__(self) -> None:
        super().__init__()
        groups = [KVCacheGroupSpec(layer_names=[f"g{i}"], spec=s) for i, s in enumerate(self.specs)]
        config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=groups)
        self.manager = KVCacheManager(config, MAX_MODEL_LEN)
        # The same operations through the general allocation path only: the definition that
        # each shortcut of the manager above must agree with on every step.
        self.general = KVCacheManager(config, MAX_MODEL_LEN, enable_shortcuts=False)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.num_requests = 0
        # block_id -> the token written in each slot: the workers' paged cache, modelled
        self.slots: dict[int, list[int | None]] = {}

    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        num_shared=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=14),
    )
    def admit_new(self, base: list[int], num_shared: int, suffix: list[int]) -> None:
        self.num_requests += 1
        tokens = [*base[:num_shared], *suffix][: MAX_MODEL_LEN - 4]
        request = Request(
            f"r{self.num_requests}", tokens, SamplingParams(), block_hasher=self.hasher
        )
        self._admit(request)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit_preempted(self, data: st.DataObject) -> None:
        request = self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1)))
        self._admit(request)

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
        assert self.general.reset_prefix_cache() == (not self.running)

    @rule()
    def finish_all(self) -> None:
        for request in list(self.running):
            self._finish(request)
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert self.manager.usage == 0.0

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        self.general.check_invariants()
        assert self._snapshot(self.manager) == self._snapshot(self.general), (
            "the shortcuts left another pool state than the general path"
        )
        shortcut_stats = self.manager.make_prefix_cache_stats()
        assert shortcut_stats == self.general.make_prefix_cache_stats()
        for request in self.running:
            for block_ids in self.manager.get_block_ids(request.req_id):
                assert len(block_ids) == cdiv(request.num_computed_tokens, BLOCK_SIZE), (
                    f"{request!r} holds {block_ids}"
                )

    def teardown(self) -> None:
        self.finish_all()
        self.consistent()

    def _admit(self, request: Request) -> None:
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        general_hits, num_general_hit_tokens = self.general.get_computed_blocks(request)
        assert (hits.get_block_ids(), num_hit_tokens, hits.shared_prefix_boundary) == (
            general_hits.get_block_ids(),
            num_general_hit_tokens,
            general_hits.shared_prefix_boundary,
        )
        self._check_hits(request, hits, num_hit_tokens)
        num_new = min(request.num_tokens - num_hit_tokens, MAX_CHUNK_TOKENS)
        new_blocks = self._allocate(request, num_new, num_hit_tokens, hits, general_hits)
        if new_blocks is None:
            self.preempted.append(request)  # waits, as the scheduler would keep it waiting
            return
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int = 0,
        hits: KVCacheBlocks | None = None,
        general_hits: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """allocate_slots on both managers, then the workers' part: write the computed tokens
        into their slots. `general_hits` are the general-path manager's own blocks of `hits`."""
        before = self._snapshot(self.manager)
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        general_blocks = self.general.allocate_slots(
            request, num_new_tokens, num_hit_tokens, general_hits
        )
        if new_blocks is None or general_blocks is None:
            assert new_blocks is None and general_blocks is None, (
                f"{request.req_id}: the shortcuts returned {new_blocks}, the general path "
                f"{general_blocks}"
            )
            assert self._snapshot(self.manager) == before, (
                "a failed allocate_slots changed the pool"
            )
            return None
        assert new_blocks.get_block_ids() == general_blocks.get_block_ids()
        assert (new_blocks is self.manager.empty_kv_cache_blocks) == (
            general_blocks is self.general.empty_kv_cache_blocks
        )
        start = request.num_computed_tokens + num_hit_tokens
        tables = self.manager.get_block_ids(request.req_id)
        for pos in range(start, start + num_new_tokens):
            for group_id, table in enumerate(tables):
                block_id = table[pos // BLOCK_SIZE]
                assert block_id != 0, f"{request!r} writes token {pos} into the null block"
                slots = self.slots.setdefault(block_id, [None] * BLOCK_SIZE)
                slots[pos % BLOCK_SIZE] = request.all_token_ids[pos]
                self._check_attention_reads(request, table, pos, self.specs[group_id])
        request.num_computed_tokens = start + num_new_tokens
        return new_blocks

    def _check_attention_reads(
        self, request: Request, table: list[int], pos: int, spec: KVCacheSpec
    ) -> None:
        """Token `pos` reads the tokens its attention spans: each must sit in its real slot."""
        read_positions = range(pos + 1)
        if isinstance(spec, SlidingWindowSpec):
            read_positions = range(max(pos - spec.sliding_window + 1, 0), pos + 1)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            chunk_size = spec.attention_chunk_size
            read_positions = range(pos // chunk_size * chunk_size, pos + 1)
        elif isinstance(spec, RSWASpec) and pos >= request.num_prompt_tokens:
            window_start = max(pos - spec.rswa_window, request.num_prompt_tokens)
            prompt = range(request.num_prompt_tokens)
            read_positions = [*prompt, *range(window_start, pos + 1)]
        for read_pos in read_positions:
            block_id = table[read_pos // BLOCK_SIZE]
            found = self.slots.get(block_id, [None] * BLOCK_SIZE)[read_pos % BLOCK_SIZE]
            assert block_id != 0 and found == request.all_token_ids[read_pos], (
                f"{request.req_id} token {pos} reads token {read_pos} from block {block_id}: "
                f"found {found}, expected {request.all_token_ids[read_pos]}"
            )

    def _check_hits(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """A hit is sound: each real hit block carries the right key and holds the right tokens."""
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens < request.num_tokens
        tokens = request.all_token_ids
        for group_id, blocks in enumerate(hits.blocks):
            assert len(blocks) == num_hit_tokens // BLOCK_SIZE
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert isinstance(self.specs[group_id], SKIPS_LEADING_BLOCKS)
                    continue
                key = make_block_hash_with_group_id(request.block_hashes[idx], group_id)
                assert block.block_hash == key
                expected = array("i", tokens[idx * BLOCK_SIZE : (idx + 1) * BLOCK_SIZE]).tolist()
                assert self.slots[block.block_id] == expected, (
                    f"false hit: block {block.block_id} holds {self.slots[block.block_id]}, "
                    f"{request.req_id} expects {expected}"
                )

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        self.general.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.preempted.append(request)

    def _finish(self, request: Request) -> None:
        self.manager.free(request)
        self.general.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        assert self.manager.get_block_ids(request.req_id) == tuple([] for _ in self.specs)

    def _snapshot(self, manager: KVCacheManager) -> tuple[object, ...]:
        """The pool's ref counts, hashes and free-queue order, and every request's tables."""
        pool = manager.block_pool
        return (
            [block.ref_cnt for block in pool.blocks],
            [block.block_hash for block in pool.blocks],
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            {r.req_id: manager.get_block_ids(r.req_id) for r in [*self.running, *self.preempted]},
        )


class HybridKVCacheManagerMachine(KVCacheManagerMachine):
    specs = (FULL, WINDOW)
    num_blocks = 36


class WindowKVCacheManagerMachine(KVCacheManagerMachine):
    """One group that skips blocks: no single-group shortcut, the in-place one instead."""

    specs = (WINDOW,)


class LocalKVCacheManagerMachine(KVCacheManagerMachine):
    """Every kind that skips blocks beside full attention, so each answers `is_step_in_place`."""

    specs = (FULL, WINDOW, CHUNKED_LOCAL, RSWA)
    num_blocks = 64


STEP_SETTINGS = settings(stateful_step_count=40)
TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = STEP_SETTINGS
TestHybridKVCacheManagerMachine = HybridKVCacheManagerMachine.TestCase
TestHybridKVCacheManagerMachine.settings = STEP_SETTINGS
TestWindowKVCacheManagerMachine = WindowKVCacheManagerMachine.TestCase
TestWindowKVCacheManagerMachine.settings = STEP_SETTINGS
TestLocalKVCacheManagerMachine = LocalKVCacheManagerMachine.TestCase
TestLocalKVCacheManagerMachine.settings = STEP_SETTINGS
