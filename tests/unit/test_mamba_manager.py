"""MambaManager scenarios with exact block ids: one reused block in mode none, checkpoints at
block boundaries in align mode (null elsewhere, returned once passed), the right-to-left hit scan,
same-step hits deferred a step, and the hybrid search beside full attention."""

import pytest
from cached_blocks import pool_with_cached
from kv_specs import hashed_request, kv_cache_config

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.mamba_manager import MambaManager
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)
from engine_core.kv_cache.spec_managers import make_single_type_manager
from engine_core.sched.request import Request

BLOCK_SIZE = 4
ALIGN = MambaSpec(BLOCK_SIZE, ((2, 3),), "float32", mamba_cache_mode="align")
NONE = MambaSpec(BLOCK_SIZE, ((2, 3),), "float32", mamba_cache_mode="none")
FULL = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")
PROMPT = list(range(100, 110))  # 10 tokens: blocks end at 4 and 8, then a partial block


def _manager(*specs: KVCacheSpec, num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    config = kv_cache_config(num_blocks, *specs)
    return KVCacheManager(config, max_model_len=64, enable_caching=caching)


def _request(req_id: str, token_ids: list[int]) -> Request:
    return hashed_request(req_id, token_ids, BLOCK_SIZE)


def _step(manager: KVCacheManager, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
    """Look up hits (first step only), allocate, and advance as the scheduler does."""
    hits, num_hit_tokens = None, 0
    if not manager.coordinator.has_request(request.req_id):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
    if new_blocks is not None:
        request.num_computed_tokens += num_hit_tokens + num_new_tokens
    manager.check_invariants()
    return new_blocks


def _decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.append_output_token_ids(token)
    assert _step(manager, request, 1) is not None


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_mode_none_keeps_one_block_per_request_across_chunks_and_decode() -> None:
    manager = _manager(NONE)
    request = _request("a", PROMPT)
    assert _step(manager, request, 4).get_block_ids() == ([1],)
    assert _step(manager, request, 6) is manager.empty_kv_cache_blocks
    for token in range(5):
        _decode(manager, request, token)
    assert manager.get_block_ids("a") == ([1],)
    assert manager.block_pool.blocks[1].block_hash is None  # never cached
    twin = _request("b", PROMPT)
    assert manager.get_computed_blocks(twin)[1] == 0
    manager.free(request)
    assert _free_ids(manager)[0] == 1  # unhashed: back at the head, reused first


def test_align_mode_without_a_prefix_cache_keeps_one_block() -> None:
    manager = _manager(ALIGN, caching=False)
    request = _request("a", PROMPT)
    _step(manager, request, 8)
    _step(manager, request, 2)
    _decode(manager, request, 7)
    assert manager.get_block_ids("a") == ([1],)


def test_align_mode_checkpoints_block_boundaries_and_returns_passed_states() -> None:
    manager = _manager(ALIGN)
    request = _request("a", PROMPT)
    # Chunk 0..8: the state after 8 tokens lands at position 1; position 0 was never written.
    assert _step(manager, request, 8).get_block_ids() == ([0, 1],)
    checkpoint = manager.block_pool.blocks[1]
    assert checkpoint.block_hash is not None
    # Chunk 8..10 starts from position 1 and writes the state after 10 at position 2.
    assert _step(manager, request, 2).get_block_ids() == ([2],)
    assert manager.get_block_ids("a") == ([0, 1, 2],)
    # The next step starts from position 2, so the checkpoint goes back to the pool (cached, at
    # the tail) and the running state is updated in place until it fills its block.
    _decode(manager, request, 7)
    _decode(manager, request, 8)
    assert manager.get_block_ids("a") == ([0, 0, 2],)
    assert _free_ids(manager)[-1] == 1 and checkpoint.block_hash is not None
    assert manager.block_pool.blocks[2].block_hash is not None  # 12 tokens: its boundary
    _decode(manager, request, 9)  # token 13 moves to a new block
    assert manager.get_block_ids("a") == ([0, 0, 2, 3],)


def test_a_chunk_ending_mid_block_caches_nothing_past_its_last_boundary() -> None:
    manager = _manager(ALIGN)
    request = _request("a", PROMPT)
    _step(manager, request, 6)  # the state after 6 tokens sits at position 1, not a boundary
    _step(manager, request, 4)  # 6..10: position 1 is "full" but holds the state after 6
    assert manager.get_block_ids("a") == ([0, 1, 2],)
    assert [manager.block_pool.blocks[idx].block_hash for idx in (1, 2)] == [None, None]


@pytest.mark.parametrize(
    ("pattern", "max_length", "hit_ids"),
    [
        ("111", 12, [0, 0, 3]),  # the last cached state wins; states before it are not needed
        ("110", 12, [0, 2]),
        ("101", 11, [1]),  # block 2 ends at 12, past max_length
        ("000", 12, []),
        ("011", 3, []),
    ],
)
def test_align_hit_is_the_last_cached_state_found_right_to_left(
    pattern: str, max_length: int, hit_ids: list[int]
) -> None:
    pool, hashes = pool_with_cached(pattern, BLOCK_SIZE, num_spare_blocks=2)
    (hits,) = MambaManager.find_longest_cache_hit(hashes, max_length, [0], pool, ALIGN)
    assert [block.block_id for block in hits] == hit_ids
    assert MambaManager.find_longest_cache_hit(hashes, max_length, [0], pool, NONE) == ([],)


def test_a_hit_resumes_from_the_checkpoint_and_returns_it_the_step_after() -> None:
    manager = _manager(ALIGN)
    first = _request("a", PROMPT)
    _step(manager, first, 8)
    _step(manager, first, 2)
    twin = _request("b", [*PROMPT, 1])
    assert _step(manager, twin, 3).get_block_ids() == ([3],)
    assert manager.get_block_ids("b") == ([0, 1, 3],)
    assert manager.block_pool.blocks[1].ref_cnt == 2
    assert manager.make_prefix_cache_stats().hits == 8
    _decode(manager, twin, 5)
    assert manager.get_block_ids("b") == ([0, 0, 3],)
    assert manager.block_pool.blocks[1].ref_cnt == 1  # still the first request's start state


def test_a_hit_on_a_checkpoint_published_this_step_waits_a_step() -> None:
    """The checkpoint's state is written by the step that publishes it: a request admitted in
    the same step would read it before it exists."""
    manager = _manager(ALIGN)
    first, twin = _request("a", PROMPT), _request("b", [*PROMPT, 1])
    assert manager.allocate_slots(first, 8) is not None  # published; not yet advanced
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(twin, 3, num_hit_tokens, hits) is None
    manager.check_invariants()
    first.num_computed_tokens += 8  # the step is planned: the next one runs after it
    assert _step(manager, twin, 3).get_block_ids() == ([2],)
    assert manager.get_block_ids("b") == ([0, 1, 2],)


def test_one_block_mode_beside_full_attention_never_hits() -> None:
    manager = _manager(FULL, NONE)
    _step(manager, _request("a", PROMPT), 10)
    assert manager.get_computed_blocks(_request("b", PROMPT))[1] == 0


def test_hybrid_hit_is_where_full_attention_and_a_checkpoint_agree() -> None:
    manager = _manager(FULL, ALIGN, num_blocks=16)
    first = _request("a", PROMPT)
    _step(manager, first, 4)  # checkpoints at 4 and 8; full attention caches blocks 0 and 1
    _step(manager, first, 4)
    _step(manager, first, 2)
    twin = _request("b", PROMPT)  # its hit stops at 9 tokens: block 1 of both groups
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    assert num_hit_tokens == 8
    full_ids, mamba_ids = hits.get_block_ids()
    assert mamba_ids == [0, manager.get_block_ids("a")[1][1]]
    assert full_ids == manager.get_block_ids("a")[0][:2]
    # Evict the checkpoint at 8: the hit falls back to the one at 4, and full attention with it.
    checkpoint_at_8 = manager.block_pool.blocks[mamba_ids[1]]
    manager.block_pool.evict_blocks([checkpoint_at_8.block_id])
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    assert num_hit_tokens == 4
    assert [len(group) for group in hits.blocks] == [1, 1]


def test_align_mode_refuses_slots_beyond_the_step() -> None:
    manager = _manager(FULL, ALIGN, num_blocks=16)
    with pytest.raises(ValueError, match="align mode allocates only for the tokens of the step"):
        manager.allocate_slots(_request("a", PROMPT), 4, num_lookahead_tokens=6)


def test_passed_states_make_room_before_an_allocation_fails() -> None:
    manager = _manager(ALIGN, num_blocks=3)  # two usable blocks
    request = _request("a", PROMPT)
    _step(manager, request, 4)
    _step(manager, request, 4)  # holds the states after 4 and 8: the pool is empty
    assert manager.block_pool.get_num_free_blocks() == 0
    assert _step(manager, request, 2).get_block_ids() == ([1],)  # the state after 4 made room
    assert manager.get_block_ids("a") == ([0, 2, 1],)


def test_factory_makes_a_mamba_manager_for_a_mamba_spec() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True)
    assert isinstance(make_single_type_manager(ALIGN, pool, 0), MambaManager)
    with pytest.raises(TypeError, match="MambaManager needs a MambaSpec"):
        MambaManager(FULL, pool, 0)


def test_a_checkpoint_whose_step_is_dropped_before_it_runs_is_not_left_cached() -> None:
    """A request preempted in the step that published its checkpoint never writes that state:
    left in the prefix cache, a later hit would resume from whatever the block held before."""
    manager = _manager(ALIGN)
    victim = _request("a", PROMPT)
    assert manager.allocate_slots(victim, 8) is not None  # publishes the checkpoint at 8
    checkpoint = manager.block_pool.blocks[manager.get_block_ids("a")[0][1]]
    assert checkpoint.block_hash is not None
    manager.free(victim)  # preempted before the step was planned: its computed tokens stay 0
    assert checkpoint.block_hash is None
    assert manager.get_computed_blocks(_request("b", PROMPT))[1] == 0
    manager.check_invariants()


def test_a_finished_request_leaves_its_last_checkpoint_cached() -> None:
    manager = _manager(ALIGN)
    request = _request("a", PROMPT)
    _step(manager, request, 8)  # planned: the step that writes the checkpoint runs
    manager.free(request)
    assert manager.get_computed_blocks(_request("b", PROMPT))[1] == 8
