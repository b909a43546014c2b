"""R-SWA through KVCacheManager: scenarios with exact block ids. The engine-path state machine over
an R-SWA group, alone and beside full attention, is in test_kv_manager_machines.py.
"""

from kv_specs import hashed_request, kv_cache_config, rswa_spec

from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.sched.request import Request, RequestStatus


def _manager(num_blocks: int = 10, rswa_window: int = 2) -> KVCacheManager:
    return KVCacheManager(kv_cache_config(num_blocks, rswa_spec(rswa_window)), 64)


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
    request = hashed_request("a", [1, 2, 3, 4, 5])
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
    first, twin = hashed_request("a", [1, 2, 3, 4, 5]), hashed_request("b", [1, 2, 3, 4, 5])
    _run(manager, first, 5)
    _run(manager, twin, 5)
    # Blocks 1-2 hold prompt positions 0-3; block 3 holds position 4 alone and is never cached.
    assert manager.get_block_ids("b") == ([1, 2, 4],)
    assert manager.make_prefix_cache_stats().hits == 4
    manager.check_invariants()


def test_blocks_past_the_prompt_are_never_cached() -> None:
    manager = _manager(rswa_window=8)
    request = hashed_request("a", [1, 2, 3, 4])
    _run(manager, request, 4)
    for token in (5, 6, 7, 8):
        request.append_output_token_ids(token)
        _run(manager, request, 1)
    blocks = manager.coordinator.get_blocks("a")[0]
    assert [block.block_hash is not None for block in blocks] == [True, True, False, False]


def test_a_resumed_request_hits_only_its_own_prompt() -> None:
    manager = _manager(num_blocks=16)
    _run(manager, hashed_request("long", [1, 2, 3, 4, 5, 6, 7, 8]), 8)  # caches 4 prompt blocks
    resumed = hashed_request("r", [1, 2, 3, 4])
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
