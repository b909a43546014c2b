"""A Hypothesis state machine over a KVCacheManager with a full-attention and a cross-attention
group, against a model of the paged cache.

A stand-in for the workers writes each computed decoder token's content (its encoder input and
its prefix) into its slot, and a request's encoder input into its cross-attention blocks when it
is admitted; every prefix hit and every encoder read is checked against what the slots hold.
"""

from array import array

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_specs import full_spec

from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    cdiv,
)
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2
MAX_MODEL_LEN = 16
MAX_CHUNK_TOKENS = 5  # prefill chunk per step, so long prompts take several steps
NUM_BLOCKS = 24
BASE_PROMPTS = ([7] * 8, list(range(100, 108)))  # prefixes requests share
ENCODER_INPUTS = ((1, 2, 3), (4, 5), (1, 2, 3, 4, 5))  # a few, so equal inputs recur
CROSS = CrossAttentionSpec(
    block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", max_num_encoder_tokens=5
)
FULL_GROUP, CROSS_GROUP = 0, 1


class CrossAttentionMachine(RuleBasedStateMachine):
    """Random admissions with shared prefixes and recurring encoder inputs, chunked prefill,
    decode, preemption and finish, with prefix caching on or off."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.num_requests = 0
        # block_id -> each slot's content: ("dec", encoder, prefix) or ("enc", encoder, idx)
        self.slots: dict[int, list[object]] = {}

    @precondition(lambda self: self.manager is None)
    @rule(enable_caching=st.booleans())
    def start(self, enable_caching: bool) -> None:
        groups = [KVCacheGroupSpec(["full"], full_spec()), KVCacheGroupSpec(["cross"], CROSS)]
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=groups)
        self.manager = KVCacheManager(config, MAX_MODEL_LEN, enable_caching=enable_caching)

    @precondition(lambda self: self.manager is not None)
    @rule(
        base=st.sampled_from(BASE_PROMPTS),
        num_shared=st.integers(0, 8),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        encoder=st.sampled_from(ENCODER_INPUTS),
    )
    def admit_new(
        self, base: list[int], num_shared: int, suffix: list[int], encoder: tuple[int, ...]
    ) -> None:
        self.num_requests += 1
        tokens = [*base[:num_shared], *suffix][: MAX_MODEL_LEN - 4]
        request = Request(
            f"r{self.num_requests}",
            tokens,
            SamplingParams(),
            block_hasher=self.hasher,
            encoder_token_ids=array("i", encoder),
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
        assert self.manager is not None
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                self._finish(request)
                return
            request.append_output_token_ids(data.draw(st.integers(0, 2)))
        num_new = min(request.num_tokens - request.num_computed_tokens, MAX_CHUNK_TOKENS)
        if self.manager.allocate_slots(request, num_new) is None:
            self._preempt(request)
            return
        self._compute(request, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    def _admit(self, request: Request) -> None:
        assert self.manager is not None
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert not hits.blocks[CROSS_GROUP], "a cross-attention block was offered as a hit"
        for idx, block in enumerate(hits.blocks[FULL_GROUP]):
            for offset in range(BLOCK_SIZE):
                expected = self._decoder_content(request, idx * BLOCK_SIZE + offset)
                assert self.slots[block.block_id][offset] == expected, (
                    f"{request.req_id} hits block {block.block_id} holding other K/V"
                )
        num_new = min(request.num_tokens - num_hit, MAX_CHUNK_TOKENS)
        new_blocks = self.manager.allocate_slots(
            request, num_new, num_hit, hits, num_encoder_tokens=request.num_encoder_tokens
        )
        if new_blocks is None:
            if request not in self.waiting:
                self.waiting.append(request)
            return
        self.running.append(request)
        request.num_computed_tokens = num_hit
        # The workers compute the encoder when a request is (re)admitted.
        encoder_ids = self.manager.get_block_ids(request.req_id)[CROSS_GROUP]
        for idx in range(request.num_encoder_tokens):
            block_slots = self.slots.setdefault(encoder_ids[idx // BLOCK_SIZE], [None] * BLOCK_SIZE)
            block_slots[idx % BLOCK_SIZE] = ("enc", request.req_id, idx)
        self._compute(request, num_new)

    def _compute(self, request: Request, num_new: int) -> None:
        """Write the decoder K/V of the scheduled tokens, as the workers would."""
        assert self.manager is not None
        decoder_ids = self.manager.get_block_ids(request.req_id)[FULL_GROUP]
        start = request.num_computed_tokens
        for pos in range(start, start + num_new):
            block_slots = self.slots.setdefault(decoder_ids[pos // BLOCK_SIZE], [None] * BLOCK_SIZE)
            block_slots[pos % BLOCK_SIZE] = self._decoder_content(request, pos)
        request.num_computed_tokens += num_new

    @staticmethod
    def _decoder_content(request: Request, pos: int) -> tuple[object, ...]:
        assert request.encoder_token_ids is not None
        prefix = tuple(request.all_token_ids[: pos + 1])
        return ("dec", tuple(request.encoder_token_ids), prefix)

    def _preempt(self, request: Request) -> None:
        assert self.manager is not None
        self.running.remove(request)
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def _finish(self, request: Request) -> None:
        assert self.manager is not None
        self.running.remove(request)
        self.manager.free(request)

    @invariant()
    def consistent(self) -> None:
        if self.manager is None:
            return
        self.manager.check_invariants()
        blocks = self.manager.block_pool.blocks
        decoder_ids: set[int] = set()
        for request in self.running:
            decoder, cross = self.manager.get_block_ids(request.req_id)
            decoder_ids.update(decoder)
            assert len(cross) == cdiv(request.num_encoder_tokens, BLOCK_SIZE), (
                f"{request.req_id} holds {len(cross)} encoder blocks for "
                f"{request.num_encoder_tokens} encoder tokens"
            )
            for idx in range(request.num_encoder_tokens):
                block_id = cross[idx // BLOCK_SIZE]
                assert blocks[block_id].ref_cnt == 1, f"encoder block {block_id} is shared"
                assert blocks[block_id].block_hash is None, f"encoder block {block_id} is hashed"
                content = self.slots[block_id][idx % BLOCK_SIZE]
                assert content == ("enc", request.req_id, idx), (
                    f"{request.req_id} reads {content} at encoder position {idx}"
                )
        for request in self.running:
            cross_ids = set(self.manager.get_block_ids(request.req_id)[CROSS_GROUP])
            assert not cross_ids & decoder_ids, f"blocks {cross_ids & decoder_ids} in two groups"
        for request in self.waiting:
            assert self.manager.get_block_ids(request.req_id) == ([], [])

    def teardown(self) -> None:
        """No leak: once every request is gone, every usable block is free again."""
        if self.manager is None:
            return
        for request in list(self.running):
            self._finish(request)
        self.manager.check_invariants()
        assert self.manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


CrossAttentionMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
test_cross_attention_beside_full_attention = CrossAttentionMachine.TestCase
