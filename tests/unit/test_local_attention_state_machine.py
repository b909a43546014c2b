"""Hypothesis state machines over the chunked-local and R-SWA managers, against a model.

A stand-in for the workers writes each computed token into its slot of a dict-based copy of the
paged cache; every token's attention reads and every prefix hit are checked against it.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.spec import ChunkedLocalAttentionSpec, KVCacheSpec, RSWASpec, cdiv
from engine_core.kv_cache.spec_managers import make_single_type_manager
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2
MAX_MODEL_LEN = 24
MAX_CHUNK_TOKENS = 5  # prefill chunk per step, so long prompts take several steps
BASE_PROMPTS = ([7] * 10, list(range(100, 110)))  # prefixes requests share
NUM_BLOCKS = 16


class LocalAttentionMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes, chunked prefill, decode, preemption and free."""

    spec: KVCacheSpec = ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", attention_chunk_size=4
    )

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True)
        self.manager = make_single_type_manager(self.spec, self.pool, 0)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.num_requests = 0
        # block_id -> what each slot holds (see slot_content): the workers' paged cache, modelled
        self.slots: dict[int, list[object]] = {}

    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        num_shared=st.integers(0, 10),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=10),
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
    def readmit(self, data: st.DataObject) -> None:
        self._admit(self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One step for one running request: its next prefill chunk, or one decode token."""
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                self._finish(request)
                return
            request.append_output_token_ids(data.draw(st.integers(0, 2)))
        num_new = min(request.num_tokens - request.num_computed_tokens, MAX_CHUNK_TOKENS)
        self.manager.remove_skipped_blocks(
            request.req_id, request.num_computed_tokens, request.num_prompt_tokens
        )
        if not self._allocate(request, request.num_computed_tokens, num_new):
            self._finish(request)
            request.num_computed_tokens = 0
            self.waiting.append(request)  # preempted: recomputed from scratch later

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @invariant()
    def consistent(self) -> None:
        """Pool and manager invariants; tables match the model; ref counts match the tables."""
        self.manager.check_invariants()
        self.pool.check_invariants()
        num_refs = [0] * NUM_BLOCKS
        for request in self.running:
            blocks = self.manager.req_to_blocks[request.req_id]
            assert len(blocks) == cdiv(request.num_computed_tokens, BLOCK_SIZE), (
                f"{request!r} holds {[block.block_id for block in blocks]}"
            )
            for block in blocks:
                if not block.is_null:
                    num_refs[block.block_id] += 1
        assert set(self.manager.req_to_blocks) == {request.req_id for request in self.running}
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == num_refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, {num_refs[block.block_id]} "
                f"tables list it"
            )
            # Two requests share a block only through a hit, so a shared block is a cached one.
            assert num_refs[block.block_id] <= 1 or block.block_hash is not None, (
                f"block {block.block_id} is held by {num_refs[block.block_id]} requests unhashed"
            )

    def teardown(self) -> None:
        for request in list(self.running):
            self._finish(request)
        self.manager.check_invariants()
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1, "a block leaked"
        assert not self.manager.req_to_blocks

    def max_hit_length(self, request: Request) -> int:
        """The longest hit a lookup may return: the last token is always computed."""
        return request.num_tokens - 1

    def slot_content(self, request: Request, pos: int) -> object:
        """What the K/V of token `pos` depends on, beyond the tokens before it: nothing here."""
        return request.all_token_ids[pos]

    def first_read_positions(self, request: Request, pos: int) -> list[int]:
        """The positions token `pos` reads: its own chunk up to itself."""
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk_size = self.spec.attention_chunk_size
        return list(range(pos // chunk_size * chunk_size, pos + 1))

    def _admit(self, request: Request) -> None:
        (hits,) = self.manager.find_longest_cache_hit(
            request.block_hashes, self.max_hit_length(request), [0], self.pool, self.spec
        )
        num_hit_tokens = len(hits) * BLOCK_SIZE
        self._check_hits(request, hits, num_hit_tokens)
        num_new = min(request.num_tokens - num_hit_tokens, MAX_CHUNK_TOKENS)
        num_needed = self.manager.get_num_blocks_to_allocate(
            request.req_id, num_hit_tokens + num_new, hits
        )
        if num_needed > self.pool.get_num_free_blocks():
            self.waiting.append(request)
            return
        self.pool.touch(hits)
        self.manager.save_new_computed_blocks(request.req_id, hits)
        self.manager.remove_skipped_blocks(
            request.req_id, num_hit_tokens, request.num_prompt_tokens
        )
        assert self._allocate(request, num_hit_tokens, num_new)
        self.running.append(request)

    def _allocate(self, request: Request, start: int, num_new_tokens: int) -> bool:
        """Capacity check, allocation, then the workers' part: write and read the slots."""
        req_id = request.req_id
        end = start + num_new_tokens
        if self.manager.get_num_blocks_to_allocate(req_id, end, []) > (
            self.pool.get_num_free_blocks()
        ):
            return False
        self.manager.allocate_new_blocks(req_id, end)
        table = self.manager.req_to_blocks[req_id]
        for pos in range(start, end):
            block = table[pos // BLOCK_SIZE]
            assert not block.is_null, f"{req_id} writes token {pos} into the null block"
            slots = self.slots.setdefault(block.block_id, [None] * BLOCK_SIZE)
            slots[pos % BLOCK_SIZE] = self.slot_content(request, pos)
            self._check_attention_reads(request, table, pos)
        self.manager.cache_blocks(request, end)
        request.num_computed_tokens = end
        return True

    def _check_attention_reads(self, request: Request, table: list[KVCacheBlock], pos: int) -> None:
        """Every token `pos` reads sits in its real slot, in no null block."""
        for read_pos in self.first_read_positions(request, pos):
            block = table[read_pos // BLOCK_SIZE]
            found = self.slots.get(block.block_id, [None] * BLOCK_SIZE)[read_pos % BLOCK_SIZE]
            expected = self.slot_content(request, read_pos)
            assert not block.is_null and found == expected, (
                f"{request.req_id} token {pos} reads token {read_pos} from block "
                f"{block.block_id}: found {found}, expected {expected}"
            )

    def _check_hits(self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int) -> None:
        """Each real hit block holds the request's tokens; nulls only where nothing is read."""
        assert num_hit_tokens <= self.max_hit_length(request)
        read_from = min(self.first_read_positions(request, num_hit_tokens), default=0)
        for idx, block in enumerate(hits):
            if block.is_null:
                assert (idx + 1) * BLOCK_SIZE <= read_from, f"null hit {idx} is still read"
                continue
            positions = range(idx * BLOCK_SIZE, (idx + 1) * BLOCK_SIZE)
            expected = [self.slot_content(request, pos) for pos in positions]
            assert self.slots[block.block_id] == expected, (
                f"false hit: block {block.block_id} holds {self.slots[block.block_id]}, "
                f"{request.req_id} expects {expected}"
            )

    def _finish(self, request: Request) -> None:
        self.manager.free(request.req_id)
        self.running.remove(request)


class RSWAMachine(LocalAttentionMachine):
    spec = RSWASpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=3
    )

    def max_hit_length(self, request: Request) -> int:
        """A resumed request must not hit past its prompt: its later tokens were generated."""
        return min(request.num_tokens - 1, request.num_prompt_tokens)

    def slot_content(self, request: Request, pos: int) -> object:
        """A generated token's K/V saw a window, a prompt token's saw every token before it."""
        return (request.all_token_ids[pos], pos < request.num_prompt_tokens)

    def first_read_positions(self, request: Request, pos: int) -> list[int]:
        """The prompt, then the `rswa_window` tokens before `pos`, and `pos` itself."""
        assert isinstance(self.spec, RSWASpec)
        num_prompt = request.num_prompt_tokens
        window_start = max(num_prompt, pos - self.spec.rswa_window)
        return [*range(min(num_prompt, pos + 1)), *range(window_start, pos + 1)]


STEP_SETTINGS = settings(stateful_step_count=40)
TestChunkedLocalAttentionMachine = LocalAttentionMachine.TestCase
TestChunkedLocalAttentionMachine.settings = STEP_SETTINGS
TestRSWAMachine = RSWAMachine.TestCase
TestRSWAMachine.settings = STEP_SETTINGS
