"""bench/trace.py, bench/replay.py, bench/scheduler_workloads.py: the seeded trace is reproducible,
its replays share prefixes and evict, and the loops the vLLM peers share run on kvserve's side."""

import argparse
import dataclasses
from array import array

from bench.kv_cache_manager import run_kvserve
from bench.replay import PoolReplayBench
from bench.scheduler import KvserveBench
from bench.scheduler_workloads import (
    add_workload_arguments,
    measure_workloads,
    num_decoding,
    workload_keys,
)
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


def test_pool_replay_bench_counts_as_the_plain_replay_and_pairs_its_samples() -> None:
    trace = make_trace(TINY)
    token_ids = [array("i", trace.token_ids(request)) for request in trace.requests]
    hasher = BlockHasher(TINY.block_size)
    bench = PoolReplayBench(
        trace, token_ids, hasher.hash_prefix, lambda n: BlockPool(n, enable_caching=True)
    )
    plain = replay_through_pool(
        BlockPool(TINY.num_gpu_blocks, enable_caching=True),
        trace,
        replay_plan(trace),
        token_ids,
        hasher.hash_prefix,
        count_evictions=True,
    )
    assert bench.result == plain
    bench.checked_pool.check_invariants()
    bench.sample(2)
    bench.check_invariants()
    assert len(bench.total_s) == len(bench.pool_only_s) == 2
    figures = bench.figures()
    assert figures["num_hit_blocks"] == plain.num_hit_blocks > 0
    assert figures["num_evicted_blocks"] == plain.num_evicted_blocks > 0
    assert figures["us_per_request"] > 0 and figures["pool_only_us_per_request"] > 0


def test_scheduler_workloads_run_every_workload_on_a_fresh_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    add_workload_arguments(parser)
    tiny = ["--decode-sizes=2,3", "--steps=2", "--num-blocks=64", "--max-model-len=256"]
    mix = ["--max-num-seqs=16", "--mix-arrivals=2", "--mix-prompt-len=20", "--mix-warmup-steps=2"]
    args = parser.parse_args([*tiny, *mix])
    assert all(hasattr(args, key) for key in workload_keys())  # every flag the peer is sent
    benches: list[KvserveBench] = []

    def new_bench() -> KvserveBench:
        benches.append(KvserveBench(args))
        return benches[-1]

    figures = measure_workloads(new_bench, args)
    assert len(benches) == 3  # one per decode size, one for the prefill mix
    assert sorted(figures) == [
        "decode_2_us_per_step",
        "decode_3_us_per_step",
        "prefill_mix_num_running_reqs",
        "prefill_mix_us_per_step",
    ]
    assert [num_decoding(bench) for bench in benches[:2]] == [2, 3]
    assert figures["prefill_mix_num_running_reqs"] == len(benches[2].scheduler.running) > 0
