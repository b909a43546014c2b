"""BlockPool throughput on a seeded serving trace, and the cost of a 1,000,000-block pool.

Replays bench/trace.py's trace (shared 1k-4k-token system prompts, user suffixes, block size 16,
eviction) through bench/replay.py's PoolReplayBench, the loop the peer (vLLM 0.33.0's BlockPool, a
fresh process per round of bench/peer_rounds.py) runs too. Run: python -m bench.block_pool
[--peer vllm [--rounds N]] [--json FILE].
"""

import os
from array import array

from bench.peer_rounds import Figures, PeerRatio, add_rounds_argument, run_rounds, summarize
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
PEER_ROUND_REPEATS = 3  # timed replays per side per round; the rounds give the ratio's median


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


RATIOS = [
    PeerRatio("ratio_throughput_vs_vllm", "us_per_request", is_ours_over_peer=False),
    PeerRatio(
        "ratio_pool_only_throughput_vs_vllm", "pool_only_us_per_request", is_ours_over_peer=False
    ),
    PeerRatio("ratio_construct_time_vs_vllm", "construct_1m_blocks_ms", is_ours_over_peer=True),
    PeerRatio(
        "ratio_memory_per_block_vs_vllm", "memory_1m_blocks_bytes_per_block", is_ours_over_peer=True
    ),
]


def measure_round(bench: PoolReplayBench, repeats: int) -> Figures:
    """Our figures of one round: `repeats` timed replays and the 1,000,000-block pool."""
    bench.total_s.clear()  # this round's samples only; the counted replay stays
    bench.pool_only_s.clear()
    bench.sample(repeats)
    figures: Figures = {"num_requests": len(bench.trace.requests)}
    figures.update(bench.figures())
    figures.update(measure_large_pool(max(1, repeats // 2), new_pool))
    return figures


def check_same_work(trace: Trace, ours: Figures, peer: Figures) -> None:
    """Both sides replayed one trace with the same hits and evictions, or no ratio holds."""
    if peer["trace_digest"] != trace_digest(trace):
        raise SystemExit("the vLLM peer replayed a different trace")
    ours_work = (ours["num_hit_blocks"], ours["num_evicted_blocks"])
    peer_work = (peer["num_hit_blocks"], peer["num_evicted_blocks"])
    if ours_work != peer_work:
        raise SystemExit(f"(hit, evicted) blocks differ: kvserve {ours_work}, vLLM {peer_work}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    add_rounds_argument(parser)
    parser.add_argument("--num-requests", type=int, default=TraceConfig.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hash-algo", choices=HASH_ALGOS, default=CacheConfig().prefix_caching_hash_algo
    )
    parser.set_defaults(repeats=PEER_ROUND_REPEATS)
    args = parser.parse_args()
    config = TraceConfig(seed=args.seed, num_requests=args.num_requests)
    trace = make_trace(config)
    bench = make_bench(trace, args.hash_algo)
    if args.peer != "vllm":
        report(TITLE, measure_round(bench, args.repeats), args.json)
        return
    peer_args = ["--config", config_to_json(config), "--repeats", str(args.repeats)]
    peer_args += ["--hash-algo", args.hash_algo]
    rounds = run_rounds(
        args.rounds,
        lambda: measure_round(bench, args.repeats),
        lambda: run_peer(args.peer_python, PEER_SCRIPT, peer_args),
        lambda ours, peer: check_same_work(trace, ours, peer),
    )
    peer_keys = [key for key in rounds[0].peer if key != "trace_digest"]
    report(TITLE, summarize(rounds, RATIOS, peer_keys), args.json)


if __name__ == "__main__":
    main()
