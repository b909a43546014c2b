"""bench/trace.py: the seeded trace is reproducible, and its replay shares prefixes and evicts."""

import dataclasses
from array import array

from bench.kv_cache_manager import run_kvserve
from bench.trace import (
    TraceConfig,
    config_from_json,
    config_to_json,
    make_trace,
    prompt_hit_rate,
    replay_plan,
    replay_through_pool,
    trace_digest,
)
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher

TINY = TraceConfig(
    seed=3,
    num_requests=40,
    block_size=4,
    num_system_prompts=3,
    system_prompt_min_tokens=16,
    system_prompt_max_tokens=40,
    suffix_min_tokens=1,
    suffix_max_tokens=12,
    output_min_tokens=1,
    output_max_tokens=10,
    vocab_size=50,
    num_gpu_blocks=64,
    max_running=4,
)


def test_same_config_gives_the_same_trace_and_digest() -> None:
    first, second = make_trace(TINY), make_trace(config_from_json(config_to_json(TINY)))
    assert first == second and trace_digest(first) == trace_digest(second)
    assert trace_digest(make_trace(dataclasses.replace(TINY, seed=4))) != trace_digest(first)


def test_requests_share_system_prompts_and_plan_their_blocks() -> None:
    trace = make_trace(TINY)
    shared = [r for r in trace.requests if r.system_prompt_idx is not None]
    assert len(shared) > len(trace.requests) // 2
    for request, step in zip(trace.requests, replay_plan(trace), strict=True):
        tokens = trace.token_ids(request)
        assert step.num_tokens == len(tokens)
        assert step.num_blocks * 4 >= len(tokens) > (step.num_blocks - 1) * 4
        assert step.max_hit_blocks * 4 < step.num_prompt_tokens == trace.prompt_len(request)


def test_replay_hits_shared_prefixes_evicts_and_frees_every_block() -> None:
    trace = make_trace(TINY)
    hasher = BlockHasher(TINY.block_size)
    token_ids = [array("i", trace.token_ids(request)) for request in trace.requests]
    pool = BlockPool(TINY.num_gpu_blocks, enable_caching=True)
    result = replay_through_pool(
        pool, trace, replay_plan(trace), token_ids, hasher.hash_prefix, count_evictions=True
    )
    pool.check_invariants()
    assert pool.get_num_free_blocks() == TINY.num_gpu_blocks - 1
    assert result.num_hit_blocks > 0 and result.num_evicted_blocks > 0
    assert 0.0 < prompt_hit_rate(trace, result) < 1.0


def test_kv_cache_manager_replay_hits_preempts_and_repeats_its_decisions() -> None:
    """Guards the benchmark's premise: every run (and the peer) makes the same decisions."""
    trace = make_trace(dataclasses.replace(TINY, num_gpu_blocks=24))  # tight: decodes preempt
    results, manager = run_kvserve(trace, repeats=2)  # raises if any block leaked
    first, second = results
    assert first.num_hit_tokens > 0 and first.num_preemptions > 0
    assert first.num_failed_allocations > 0 and first.num_allocations > len(trace.requests)
    counts = ("num_hit_tokens", "num_preemptions", "num_allocations", "num_failed_allocations")
    assert [getattr(first, c) for c in counts] == [getattr(second, c) for c in counts]
    manager.check_invariants()
