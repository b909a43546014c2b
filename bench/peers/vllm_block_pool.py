"""The vLLM 0.33.0 side of bench/block_pool.py: the same trace through vLLM's own BlockPool.

Runs under the peer interpreter and never imports kvserve: the trace and the timed replay come
from bench/trace.py and bench/replay.py, which use the standard library only. Prints one JSON
object as its last line, with the same keys as the kvserve side.
"""

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.replay import PoolReplayBench, measure_large_pool  # importable thanks to the path above
from bench.trace import config_from_json, make_trace, trace_digest


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

    token_ids = [trace.token_ids(request) for request in trace.requests]
    bench = PoolReplayBench(
        trace, token_ids, make_hash_prefix(config.block_size, args.hash_algo), new_pool
    )
    bench.sample(args.repeats)  # alternating, as kvserve's side
    figures = {"trace_digest": trace_digest(trace)}
    figures.update(bench.figures())
    figures.update(measure_large_pool(max(1, args.repeats // 2), new_pool))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
