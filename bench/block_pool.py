"""BlockPool throughput on a seeded serving trace, and the cost of a 1,000,000-block pool.

Replays bench/trace.py's trace (shared 1k-4k-token system prompts, user suffixes, block size 16,
eviction under pressure): per request hash, lookup, touch, allocate, cache, free tail first.
Run: python -m bench.block_pool [--peer vllm] [--json FILE]; the peer is vLLM 0.33.0's BlockPool.
"""

import gc
import os
import statistics
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


class ReplayBench:
    """The trace, its tokens and precomputed hashes, and one checked replay for the counts."""

    def __init__(self, trace: Trace, algo: str) -> None:
        self.trace = trace
        self.plan = replay_plan(trace)
        self.token_ids = [array("i", trace.token_ids(request)) for request in trace.requests]
        self.hasher = BlockHasher(trace.config.block_size, algo)
        self.hashes = [self.hasher.hash_prefix(tokens) for tokens in self.token_ids]
        num_gpu_blocks = trace.config.num_gpu_blocks
        pool = BlockPool(num_gpu_blocks, enable_caching=True)
        self.result = replay_through_pool(
            pool, trace, self.plan, self.token_ids, None, self.hashes, True
        )
        pool.check_invariants()
        assert pool.get_num_free_blocks() == num_gpu_blocks - 1, "the replay leaked blocks"
        self.total_s: list[float] = []  # one sample per run, hashing included
        self.pool_only_s: list[float] = []  # one sample per run, hashes precomputed

    def sample(self, repeats: int) -> None:
        """Time `repeats` replays each way, alternating, so load drift hits both alike."""
        for _ in range(repeats):
            self.total_s.append(self._time_replay(with_hashing=True))
            self.pool_only_s.append(self._time_replay(with_hashing=False))

    def _time_replay(self, with_hashing: bool) -> float:
        pool = BlockPool(self.trace.config.num_gpu_blocks, enable_caching=True)
        hash_prefix, hashes = (
            (self.hasher.hash_prefix, None) if with_hashing else (None, self.hashes)
        )
        args = (pool, self.trace, self.plan, self.token_ids, hash_prefix, hashes)
        gc.collect()
        return time_call_s(lambda: replay_through_pool(*args))

    def figures(self) -> dict[str, float | int]:
        num_requests = len(self.trace.requests)
        total_s = statistics.median(self.total_s)
        return {
            "us_per_request": total_s / num_requests * 1e6,
            "requests_per_s": num_requests / total_s,
            "pool_only_us_per_request": statistics.median(self.pool_only_s) / num_requests * 1e6,
            "prefix_hit_rate": prompt_hit_rate(self.trace, self.result),
            "num_hit_blocks": self.result.num_hit_blocks,
            "num_evicted_blocks": self.result.num_evicted_blocks,
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
    parser.add_argument("--hash-algo", choices=["sha256", "xxhash"], default="sha256")
    args = parser.parse_args()
    config = TraceConfig(seed=args.seed, num_requests=args.num_requests)
    trace = make_trace(config)
    bench = ReplayBench(trace, args.hash_algo)
    bench.sample(args.repeats)
    large_pool = measure_large_pool(max(1, args.repeats // 2))
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
