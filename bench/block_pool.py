"""BlockPool throughput on a seeded serving trace, and the cost of a 1,000,000-block pool.

Replays bench/trace.py's trace (shared 1k-4k-token system prompts, user suffixes, block size 16,
eviction under pressure) through bench/replay.py's PoolReplayBench, the loop the peer runs too.
Run: python -m bench.block_pool [--peer vllm] [--json FILE]; the peer is vLLM 0.33.0's BlockPool.
"""

import os
from array import array

from bench.replay import PoolReplayBench, measure_large_pool
from bench.report import add_peer_arguments, base_parser, report, run_peer
from bench.trace import Trace, TraceConfig, config_to_json, make_trace, trace_digest
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHasher
from protocol.config import HASH_ALGOS, CacheConfig

TITLE = (
    "BlockPool on a seeded serving trace. ratio_throughput: vLLM's time over ours (target >= 1); "
    "ratio_construct_time and ratio_memory: ours over vLLM's (target <= 1)"
)
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_block_pool.py")


def new_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, enable_caching=True)


def make_bench(trace: Trace, algo: str) -> PoolReplayBench:
    """The shared replay over kvserve's pool and hasher, its counted run checked for leaks."""
    token_ids = [array("i", trace.token_ids(request)) for request in trace.requests]
    hasher = BlockHasher(trace.config.block_size, algo)
    bench = PoolReplayBench(trace, token_ids, hasher.hash_prefix, new_pool)
    bench.checked_pool.check_invariants()
    num_free = bench.checked_pool.get_num_free_blocks()
    assert num_free == trace.config.num_gpu_blocks - 1, "the replay leaked blocks"
    return bench


def add_vllm_figures(figures: dict, peer: dict, trace: Trace) -> None:
    """The peer's figures and the ratios, once the peer is shown to have done the same work."""
    if peer.pop("trace_digest") != trace_digest(trace):
        raise SystemExit("the vLLM peer replayed a different trace")
    ours = (figures["num_hit_blocks"], figures["num_evicted_blocks"])
    theirs = (peer["num_hit_blocks"], peer["num_evicted_blocks"])
    if ours != theirs:
        raise SystemExit(f"(hit, evicted) blocks differ: kvserve {ours}, vLLM {theirs}")
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


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=TraceConfig.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hash-algo", choices=HASH_ALGOS, default=CacheConfig().prefix_caching_hash_algo
    )
    args = parser.parse_args()
    config = TraceConfig(seed=args.seed, num_requests=args.num_requests)
    trace = make_trace(config)
    bench = make_bench(trace, args.hash_algo)
    bench.sample(args.repeats)
    large_pool = measure_large_pool(max(1, args.repeats // 2), new_pool)
    peer = None
    if args.peer == "vllm":
        peer_args = ["--config", config_to_json(config), "--repeats", str(args.repeats)]
        peer = run_peer(args.peer_python, PEER_SCRIPT, [*peer_args, "--hash-algo", args.hash_algo])
        bench.sample(args.repeats)  # as many again after the peer: both sides see the same drift
    figures: dict[str, float | int | str] = {"num_requests": config.num_requests}
    figures.update(bench.figures())
    figures.update(large_pool)
    if peer is not None:
        add_vllm_figures(figures, peer, trace)
    report(TITLE, figures, args.json)


if __name__ == "__main__":
    main()
