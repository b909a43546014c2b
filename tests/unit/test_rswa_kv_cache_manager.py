"""R-SWA through KVCacheManager: scenarios with exact block ids, then the engine-path state machine
(allocate_slots, preemption, reset) over an R-SWA group, alone and beside full attention.
"""

from array import array

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule
from test_kv_cache_manager_state_machine import (
    FULL,
    MAX_MODEL_LEN,
    STEP_SETTINGS,
    KVCacheManagerMachine,
)

from engine_core.kv_cache.hashing import BlockHasher, make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, RSWASpec
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

BLOCK_SIZE = 2
RSWA = RSWASpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=3)


def _manager(num_blocks: int = 10, rswa_window: int = 2) -> KVCacheManager:
    spec = RSWASpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", rswa_window=rswa_window
    )
    group = KVCacheGroupSpec(layer_names=["layers.0"], spec=spec)
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[group]), 64)


def _request(req_id: str, token_ids: list[int]) -> Request:
    return Request(req_id, token_ids, SamplingParams(), block_hasher=BlockHasher(BLOCK_SIZE))


def _run(manager: KVCacheManager, request: Request, num_new_tokens: int) -> None:
    """Allocate `num_new_tokens` more and mark them computed, as a scheduler step would."""
    hits, num_hit_tokens = KVCacheBlocks(((),)), 0
    if not manager.coordinator.has_request(request.req_id):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens -= num_hit_tokens
    assert manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits) is not None
    request.num_computed_tokens += num_hit_tokens + num_new_tokens


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_decode_nulls_and_frees_the_gap_after_the_prompt() -> None:
    manager = _manager(rswa_window=2)
    request = _request("a", [1, 2, 3, 4, 5])
    _run(manager, request, 5)
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    for token in range(6):  # positions 5..10: each decode reads the prompt and 2 tokens before
        request.append_output_token_ids(token)
        _run(manager, request, 1)
    # Token 10 reads 0..4 (prompt) and 8..10: block 4 (positions 6-7) is the gap. It was never
    # cached, so it goes back at the head of the free queue and holds positions 10-11 at once.
    assert manager.get_block_ids("a") == ([1, 2, 3, 0, 5, 4],)
    assert _free_ids(manager) == [6, 7, 8, 9]
    manager.check_invariants()


def test_first_allocation_caches_the_prompt_so_a_twin_in_the_same_step_shares_it() -> None:
    manager = _manager()
    first, twin = _request("a", [1, 2, 3, 4, 5]), _request("b", [1, 2, 3, 4, 5])
    _run(manager, first, 5)
    _run(manager, twin, 5)
    # Blocks 1-2 hold prompt positions 0-3; block 3 holds position 4 alone and is never cached.
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    assert manager.make_prefix_cache_stats().hits == 4
    manager.check_invariants()


def test_blocks_past_the_prompt_are_never_cached() -> None:
    manager = _manager(rswa_window=8)
    request = _request("a", [1, 2, 3, 4])
    _run(manager, request, 4)
    for token in (5, 6, 7, 8):
        request.append_output_token_ids(token)
        _run(manager, request, 1)
    blocks = manager.coordinator.get_blocks("a")[0]
    assert [block.block_hash is not None for block in blocks] == [True, True, False, False]


def test_a_resumed_request_hits_only_its_own_prompt() -> None:
    manager = _manager(num_blocks=16)
    _run(manager, _request("long", [1, 2, 3, 4, 5, 6, 7, 8]), 8)  # caches 4 prompt blocks
    resumed = _request("r", [1, 2, 3, 4])
    _run(manager, resumed, 4)
    for token in (5, 6, 7):  # the same tokens "long" had as its prompt, but generated here
        resumed.append_output_token_ids(token)
    manager.free(resumed)
    resumed.status = RequestStatus.PREEMPTED
    resumed.num_computed_tokens = 0
    resumed.num_preemptions += 1
    hits, num_hit_tokens = manager.get_computed_blocks(resumed)
    assert num_hit_tokens == 4
    assert hits.get_block_ids() == ([1, 2],)


class RSWAKVCacheManagerMachine(KVCacheManagerMachine):
    """The engine-path machine over R-SWA; each slot also records whether it was written as a
    prompt token, since a generated token's K/V saw a window and a prompt token's did not."""

    specs: tuple[KVCacheSpec, ...] = (RSWA,)
    num_blocks = 24

    def __init__(self) -> None:
        super().__init__()
        self.is_prompt_slot: dict[int, list[bool | None]] = {}  # block_id -> kind per slot

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Preempt a request at will, so resumed requests with generated tokens look up hits."""
        self._preempt(self.running[data.draw(st.integers(0, len(self.running) - 1))])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def admit_extension(self, data: st.DataObject, token: int) -> None:
        """Admit a prompt that is another request's tokens so far, generated ones included: its
        prompt blocks then cache what the other request computed as generated tokens."""
        other = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if other.num_tokens >= MAX_MODEL_LEN - 4:
            return
        self.num_requests += 1
        tokens = [*other.all_token_ids, token]
        request = Request(
            f"r{self.num_requests}", tokens, SamplingParams(), block_hasher=self.hasher
        )
        self._admit(request)

    def _check_attention_reads(
        self, request: Request, table: list[int], pos: int, spec: KVCacheSpec
    ) -> None:
        """Record how token `pos` was just written, then check what it reads.

        The base machine calls this right after writing token `pos` into `table`. An R-SWA token
        reads the whole prompt and the `rswa_window` tokens before it; full attention reads all.
        """
        block_id = table[pos // BLOCK_SIZE]
        kinds = self.is_prompt_slot.setdefault(block_id, [None] * BLOCK_SIZE)
        kinds[pos % BLOCK_SIZE] = pos < request.num_prompt_tokens
        num_prompt = request.num_prompt_tokens
        read_positions = range(pos + 1)
        if isinstance(spec, RSWASpec):
            window_start = max(num_prompt, pos - spec.rswa_window)
            read_positions = [*range(min(num_prompt, pos + 1)), *range(window_start, pos + 1)]
        for read_pos in read_positions:
            block_id = table[read_pos // BLOCK_SIZE]
            slot = read_pos % BLOCK_SIZE
            found = self.slots.get(block_id, [None] * BLOCK_SIZE)[slot]
            kind = self.is_prompt_slot.get(block_id, [None] * BLOCK_SIZE)[slot]
            assert block_id != 0 and found == request.all_token_ids[read_pos], (
                f"{request.req_id} token {pos} reads token {read_pos} from block {block_id}: "
                f"found {found}, expected {request.all_token_ids[read_pos]}"
            )
            # Full attention computes the same K/V either way; R-SWA does not.
            assert not isinstance(spec, RSWASpec) or kind == (read_pos < num_prompt), (
                f"{request.req_id} token {pos} reads position {read_pos} from block {block_id}, "
                f"written as {'prompt' if kind else 'generated'}"
            )

    def _check_hits(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """Hit blocks hold the request's tokens, written as prompt tokens, within its prompt."""
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens < request.num_tokens
        assert num_hit_tokens <= request.num_prompt_tokens
        tokens = request.all_token_ids
        for group_id, blocks in enumerate(hits.blocks):
            assert len(blocks) == num_hit_tokens // BLOCK_SIZE
            for idx, block in enumerate(blocks):
                assert not block.is_null, f"{request.req_id} hits the null block at {idx}"
                key = make_block_hash_with_group_id(request.block_hashes[idx], group_id)
                assert block.block_hash == key
                expected = array("i", tokens[idx * BLOCK_SIZE : (idx + 1) * BLOCK_SIZE]).tolist()
                assert self.slots[block.block_id] == expected, (
                    f"false hit: block {block.block_id} holds {self.slots[block.block_id]}, "
                    f"{request.req_id} expects {expected}"
                )
                if isinstance(self.specs[group_id], RSWASpec):
                    assert self.is_prompt_slot[block.block_id] == [True] * BLOCK_SIZE, (
                        f"false hit: R-SWA block {block.block_id} holds generated K/V"
                    )


class HybridRSWAKVCacheManagerMachine(RSWAKVCacheManagerMachine):
    specs = (FULL, RSWA)
    num_blocks = 40


TestRSWAKVCacheManagerMachine = RSWAKVCacheManagerMachine.TestCase
TestRSWAKVCacheManagerMachine.settings = STEP_SETTINGS
TestHybridRSWAKVCacheManagerMachine = HybridRSWAKVCacheManagerMachine.TestCase
TestHybridRSWAKVCacheManagerMachine.settings = STEP_SETTINGS
