"""The vLLM 0.33.0 side of bench/block_pool.py: the same trace through vLLM's own BlockPool.

Runs under the peer interpreter and never imports kvserve: the trace and the replay loop come
from bench/trace.py, which uses the standard library only. Prints one JSON object as its last
line, with the same keys as the kvserve side.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.trace import (  # importable thanks to the path above
    Trace,
    config_from_json,
    make_trace,
    prompt_hit_rate,
    replay_plan,
    replay_through_pool,
    trace_digest,
)

LARGE_POOL_BLOCKS = 1_000_000


def make_hash_prefix(block_size: int, algo: str) -> Callable[[list[int]], list[bytes]]:
    """vLLM's chained block hash, as its request block hasher computes it, over a token list."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)

    def hash_prefix(tokens: list[int]) -> list[bytes]:
        hashes, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], None)
            hashes.append(parent)
        return hashes

    return hash_prefix


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_replay(
    trace: Trace, algo: str, repeats: int, new_pool: Callable[[int], object]
) -> dict:
    """The same figures as the kvserve side: with hashing, and with hashes precomputed."""
    config = trace.config
    plan = replay_plan(trace)
    token_ids = [trace.token_ids(request) for request in trace.requests]
    hash_prefix = make_hash_prefix(config.block_size, algo)
    hashes = [hash_prefix(tokens) for tokens in token_ids]
    checked = new_pool(config.num_gpu_blocks)
    result = replay_through_pool(checked, trace, plan, token_ids, None, hashes, True)

    def run(with_hashing: bool) -> float:
        pool = new_pool(config.num_gpu_blocks)
        fn, precomputed = (hash_prefix, None) if with_hashing else (None, hashes)
        return timed(lambda: replay_through_pool(pool, trace, plan, token_ids, fn, precomputed))

    num_requests = len(trace.requests)
    samples = [(run(True), run(False)) for _ in range(repeats)]  # alternating, as kvserve's side
    total_s = statistics.median(total for total, _ in samples)
    pool_s = statistics.median(pool for _, pool in samples)
    return {
        "us_per_request": total_s / num_requests * 1e6,
        "requests_per_s": num_requests / total_s,
        "pool_only_us_per_request": pool_s / num_requests * 1e6,
        "prefix_hit_rate": prompt_hit_rate(trace, result),
        "num_hit_blocks": result.num_hit_blocks,
        "num_evicted_blocks": result.num_evicted_blocks,
    }


def measure_large_pool(repeats: int, new_pool: Callable[[int], object]) -> dict:
    construct_s = statistics.median(
        timed(lambda: new_pool(LARGE_POOL_BLOCKS)) for _ in range(repeats)
    )
    gc.collect()
    tracemalloc.start()
    pool = new_pool(LARGE_POOL_BLOCKS)
    size_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool
    return {
        "construct_1m_blocks_ms": construct_s * 1e3,
        "memory_1m_blocks_bytes_per_block": size_bytes / LARGE_POOL_BLOCKS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TraceConfig as JSON")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hash-algo", default="sha256")
    args = parser.parse_args()

    from vllm.v1.core.block_pool import BlockPool

    config = config_from_json(args.config)
    trace = make_trace(config)

    def new_pool(num_blocks: int) -> BlockPool:
        return BlockPool(num_blocks, enable_caching=True, hash_block_size=config.block_size)

    figures = {"trace_digest": trace_digest(trace)}
    figures.update(measure_replay(trace, args.hash_algo, args.repeats, new_pool))
    figures.update(measure_large_pool(max(1, args.repeats // 2), new_pool))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
