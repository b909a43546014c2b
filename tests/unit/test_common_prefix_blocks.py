"""KVCacheManager.get_num_common_prefix_blocks: a scenario, then a property test against a
brute-force count over the running requests' block tables."""

import hypothesis.strategies as st
from hypothesis import given, settings
from kv_specs import (
    chunked_local_spec,
    full_spec,
    hashed_request,
    kv_cache_config,
    rswa_spec,
    window_spec,
)

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
)
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams

MAX_MODEL_LEN = 64
NUM_BLOCKS = 256  # room for every request, so no allocation is refused
FULL = full_spec()
SPEC_SETS: tuple[tuple[KVCacheSpec, ...], ...] = (
    (FULL,),
    (FULL, FULL),
    (FULL, window_spec(3)),
    (FULL, rswa_spec(3)),
    (FULL, chunked_local_spec(4)),
)
BASE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def _manager(specs: tuple[KVCacheSpec, ...], enable_caching: bool = True) -> KVCacheManager:
    config = kv_cache_config(NUM_BLOCKS, *specs)
    return KVCacheManager(config, MAX_MODEL_LEN, enable_caching=enable_caching)


def _admit(manager: KVCacheManager, req_id: str, tokens: list[int]) -> Request:
    request = hashed_request(req_id, tokens)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new, num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return request


def _brute_force(
    manager: KVCacheManager, specs: tuple[KVCacheSpec, ...], req_id: str, running: list[Request]
) -> list[int]:
    """Per group: leading positions where every running table lists the same real block."""
    tables = [manager.get_block_ids(request.req_id) for request in running]
    mine = manager.get_block_ids(req_id)
    counts = []
    for group_id, spec in enumerate(specs):
        num_common = 0
        if type(spec) is FullAttentionSpec:
            for idx, block_id in enumerate(mine[group_id]):
                if block_id == 0 or any(
                    len(table[group_id]) <= idx or table[group_id][idx] != block_id
                    for table in tables
                ):
                    break
                num_common += 1
        counts.append(num_common)
    return counts


def test_three_requests_share_the_blocks_all_of_them_hit() -> None:
    manager = _manager((FULL, SPEC_SETS[2][1]))
    _admit(manager, "a", BASE_PROMPT[:7])  # blocks of positions 0-1, 2-3, 4-5 cached
    _admit(manager, "b", BASE_PROMPT[:7])  # hits 3 blocks
    _admit(manager, "c", [*BASE_PROMPT[:4], 0, 0, 0])  # hits 2 blocks
    assert manager.get_num_common_prefix_blocks("a", 3) == [2, 0]
    assert manager.get_num_common_prefix_blocks("b", 2) == [0, 0]  # counts must match exactly
    manager.free(Request("c", [0], SamplingParams()))
    assert manager.get_num_common_prefix_blocks("a", 2) == [3, 0]
    assert manager.get_num_common_prefix_blocks("unknown", 2) == [0, 0]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.sampled_from(SPEC_SETS),
    enable_caching=st.booleans(),
    prompts=st.lists(
        st.tuples(st.integers(0, len(BASE_PROMPT)), st.lists(st.integers(0, 2), max_size=6)),
        min_size=1,
        max_size=6,
    ),
    steps=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), max_size=12),
    frees=st.lists(st.integers(0, 5), max_size=3),
)
def test_common_prefix_blocks_match_a_brute_force_count(
    specs: tuple[KVCacheSpec, ...],
    enable_caching: bool,
    prompts: list[tuple[int, list[int]]],
    steps: list[tuple[int, int]],
    frees: list[int],
) -> None:
    """Admissions sharing prefixes, decode steps and frees; then every running request's count
    equals the brute-force one (every request holding blocks is running, as the method needs)."""
    manager = _manager(specs, enable_caching)
    running = [
        _admit(manager, f"r{idx}", [*BASE_PROMPT[:num_shared], *suffix] or [1])
        for idx, (num_shared, suffix) in enumerate(prompts)
    ]
    for request_idx, token in steps:
        request = running[request_idx % len(running)]
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    for request_idx in frees:
        if len(running) > 1:
            manager.free(running.pop(request_idx % len(running)))
    for request in running:
        expected = _brute_force(manager, specs, request.req_id, running)
        assert manager.get_num_common_prefix_blocks(request.req_id, len(running)) == expected
    manager.check_invariants()
