"""The vLLM 0.33.0 side of bench/kv_cache_manager.py: the same trace through vLLM's KVCacheManager.

Runs under the peer interpreter and never imports kvserve; it imports only bench/trace.py, which
is standard library only, to rebuild the identical trace. Prints one JSON object as its last
line: median seconds, the counts of what the replay did, and the trace digest.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.trace import Trace, config_from_json, make_trace, trace_digest

MAX_MODEL_LEN = 8192  # above the trace's longest sequence, so the cap never bites


def build_requests(trace: Trace, block_hasher: object) -> tuple[list, list[list[int]]]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    requests, outputs = [], []
    for item in trace.requests:
        prompt = trace.token_ids(item)[: trace.prompt_len(item)]
        request = Request(
            request_id=item.req_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=len(item.output_token_ids)),
            pooling_params=None,
            block_hasher=block_hasher,
        )
        requests.append(request)
        outputs.append(item.output_token_ids)
    return requests, outputs


class Replay:
    """The replay rule of bench/kv_cache_manager.py, line for line, on vLLM's API.

    Each step admits the head of the waiting queue when fewer than `max_running` run, then gives
    every running request one token: a finished one is freed, and a decode that does not fit
    preempts the youngest running request (possibly itself) to the front of the queue.
    """

    def __init__(self, manager: object, requests: list, outputs: list[list[int]]) -> None:
        self.manager, self.requests, self.outputs = manager, requests, outputs
        self.waiting, self.running = deque(range(len(requests))), []
        self.manager_s = 0.0
        self.num_hit_tokens = self.num_preemptions = self.num_allocations = self.num_failed = 0

    def run(self, max_running: int) -> dict:
        start = time.perf_counter()
        while self.waiting or self.running:
            if self.waiting and len(self.running) < max_running:
                self.admit_head()
            for idx in list(self.running):
                if idx in self.running:  # not preempted earlier in this step
                    self.decode(idx)
        replay_s = time.perf_counter() - start
        return {
            "manager_s": self.manager_s,
            "replay_s": replay_s,
            "num_hit_tokens": self.num_hit_tokens,
            "num_preemptions": self.num_preemptions,
            "num_allocations": self.num_allocations,
            "num_failed_allocations": self.num_failed,
        }

    def admit_head(self) -> None:
        request = self.requests[self.waiting[0]]
        start = time.perf_counter()
        hits, num_hits, _ = self.manager.get_computed_blocks(request)
        new_blocks = self.manager.allocate_slots(
            request, request.num_tokens - num_hits, num_hits, hits
        )
        self.manager_s += time.perf_counter() - start
        self.num_allocations += 1
        if new_blocks is None:
            self.num_failed += 1
            return
        self.running.append(self.waiting.popleft())
        request.num_computed_tokens = request.num_tokens
        self.num_hit_tokens += num_hits

    def decode(self, idx: int) -> None:
        request, output = self.requests[idx], self.outputs[idx]
        if request.num_output_tokens == len(output):
            self.free(request)
            self.running.remove(idx)
            return
        request.append_output_token_ids(output[request.num_output_tokens])
        while True:
            start = time.perf_counter()
            new_blocks = self.manager.allocate_slots(request, 1)
            self.manager_s += time.perf_counter() - start
            self.num_allocations += 1
            if new_blocks is not None:
                request.num_computed_tokens += 1
                return
            self.num_failed += 1
            if self.preempt_youngest() == idx:
                return

    def preempt_youngest(self) -> int:
        from vllm.v1.request import RequestStatus

        victim_idx = self.running.pop()
        victim = self.requests[victim_idx]
        self.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim_idx)
        return victim_idx

    def free(self, request: object) -> None:
        start = time.perf_counter()
        self.manager.free(request)
        self.manager_s += time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace-config", required=True, help="TraceConfig as JSON")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    trace = make_trace(config_from_json(args.trace_config))
    config = trace.config
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    block_hasher = get_request_block_hasher(config.block_size, hash_fn)
    spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    results = []
    for _ in range(args.repeats):
        requests, outputs = build_requests(trace, block_hasher)
        manager = KVCacheManager(
            kv_cache_config,
            MAX_MODEL_LEN,
            scheduler_block_size=config.block_size,
            hash_block_size=config.block_size,
            enable_caching=True,
            log_stats=False,
        )
        results.append(Replay(manager, requests, outputs).run(config.max_running))
    figures = dict(results[0])
    figures["manager_s"] = statistics.median(r["manager_s"] for r in results)
    figures["replay_s"] = statistics.median(r["replay_s"] for r in results)
    figures["trace_digest"] = trace_digest(trace)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
