"""BlockPool throughput on a seeded serving trace, and the cost of a 1,000,000-block pool.

Replays bench/trace.py's trace (shared system prompts of 1k-4k tokens, user suffixes, block
size 16, eviction under memory pressure): per request hash, lookup, touch, allocate, cache, and
free tail first. With `--peer vllm` the same loop runs through vLLM 0.33.0's BlockPool.
Run: python -m bench.block_pool [--peer vllm] [--json FILE]
"""

import gc
import os
import tracemalloc
from array import array

from bench.report import add_peer_arguments, base_parser, median_of, report, run_peer, time_call_s
from bench.trace import (
    Trace,
    TraceConfig,
    config_to_json,
    make_trace,
    prompt_hit_rate,
    replay_plan,
    replay_through_pool,
    trace_digest,
)
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher

LARGE_POOL_BLOCKS = 1_000_000
TITLE = (
    "BlockPool on a seeded serving trace. ratio_throughput: vLLM's time over ours (target >= 1); "
    "ratio_construct_time and ratio_memory: ours over vLLM's (target <= 1)"
)
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_block_pool.py")


def measure_replay(trace: Trace, algo: str, repeats: int) -> dict[str, float | int]:
    """Median µs per request with hashing, and with hashes precomputed (the pool alone)."""
    plan = replay_plan(trace)
    token_ids = [array("i", trace.token_ids(request)) for request in trace.requests]
    hasher = BlockHasher(trace.config.block_size, algo)
    hashes = [hasher.hash_prefix(tokens) for tokens in token_ids]
    num_gpu_blocks = trace.config.num_gpu_blocks
    checked = BlockPool(num_gpu_blocks, enable_caching=True)
    result = replay_through_pool(checked, trace, plan, token_ids, None, hashes, True)
    checked.check_invariants()
    assert checked.get_num_free_blocks() == num_gpu_blocks - 1, "the replay leaked blocks"

    def run(with_hashing: bool) -> float:
        pool = BlockPool(num_gpu_blocks, enable_caching=True)
        hash_prefix, precomputed = (hasher.hash_prefix, None) if with_hashing else (None, hashes)
        gc.collect()
        return time_call_s(
            lambda: replay_through_pool(pool, trace, plan, token_ids, hash_prefix, precomputed)
        )

    num_requests = len(trace.requests)
    total_s = median_of(lambda: run(True), repeats)
    pool_s = median_of(lambda: run(False), repeats)
    return {
        "us_per_request": total_s / num_requests * 1e6,
        "requests_per_s": num_requests / total_s,
        "pool_only_us_per_request": pool_s / num_requests * 1e6,
        "prefix_hit_rate": prompt_hit_rate(trace, result),
        "num_hit_blocks": result.num_hit_blocks,
        "num_evicted_blocks": result.num_evicted_blocks,
    }


def measure_large_pool(repeats: int) -> dict[str, float]:
    """Construction time (median) and traced memory of a pool of 1,000,000 blocks."""

    def build() -> float:
        gc.collect()
        return time_call_s(lambda: BlockPool(LARGE_POOL_BLOCKS, enable_caching=True))

    construct_s = median_of(build, repeats)
    gc.collect()
    tracemalloc.start()
    pool = BlockPool(LARGE_POOL_BLOCKS, enable_caching=True)
    size_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool
    return {
        "construct_1m_blocks_ms": construct_s * 1e3,
        "memory_1m_blocks_bytes_per_block": size_bytes / LARGE_POOL_BLOCKS,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=TraceConfig.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hash-algo", choices=["sha256", "xxhash"], default="sha256")
    args = parser.parse_args()
    config = TraceConfig(seed=args.seed, num_requests=args.num_requests)
    trace = make_trace(config)
    figures: dict[str, float | int | str] = {"num_requests": config.num_requests}
    figures.update(measure_replay(trace, args.hash_algo, args.repeats))
    figures.update(measure_large_pool(max(1, args.repeats // 2)))
    if args.peer == "vllm":
        peer = run_peer(
            args.peer_python,
            PEER_SCRIPT,
            [
                "--config",
                config_to_json(config),
                "--repeats",
                str(args.repeats),
                "--hash-algo",
                args.hash_algo,
            ],
        )
        if peer.pop("trace_digest") != trace_digest(trace):
            raise SystemExit("the vLLM peer replayed a different trace")
        figures["same_hits_and_evictions_as_vllm"] = str(
            (peer["num_hit_blocks"], peer["num_evicted_blocks"])
            == (figures["num_hit_blocks"], figures["num_evicted_blocks"])
        )
        figures.update({f"vllm_{key}": value for key, value in peer.items()})
        figures["ratio_throughput_vs_vllm"] = peer["us_per_request"] / figures["us_per_request"]
        figures["ratio_pool_only_throughput_vs_vllm"] = (
            peer["pool_only_us_per_request"] / figures["pool_only_us_per_request"]
        )
        figures["ratio_construct_time_vs_vllm"] = (
            figures["construct_1m_blocks_ms"] / peer["construct_1m_blocks_ms"]
        )
        figures["ratio_memory_per_block_vs_vllm"] = (
            figures["memory_1m_blocks_bytes_per_block"] / peer["memory_1m_blocks_bytes_per_block"]
        )
    report(TITLE, figures, args.json)


if __name__ == "__main__":
    main()
