"""Requests per second through KVCacheManager on the seeded serving trace, against vLLM's.

A small continuous-batching loop over bench/trace.py (the Replay class states its rule); building
the Requests (hashing their prompts) stays out of the figures on both sides. Run:
    .venv/bin/python -m bench.kv_cache_manager [--peer vllm] [--json FILE]
"""

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

from bench.report import add_peer_arguments, base_parser, report, run_peer
from bench.trace import Trace, TraceConfig, config_to_json, make_trace, trace_digest
from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_kv_cache_manager.py")
MAX_MODEL_LEN = 8192  # above the trace's longest sequence, so the cap never bites


@dataclass(slots=True)
class ReplayResult:
    """What one replay did; both sides must agree on every count for the same trace."""

    manager_s: float  # time inside get_computed_blocks, allocate_slots and free
    replay_s: float  # the whole loop, token appends and bookkeeping included
    num_hit_tokens: int
    num_preemptions: int
    num_allocations: int
    num_failed_allocations: int


def build_requests(trace: Trace) -> tuple[list[Request], list[list[int]]]:
    hasher = BlockHasher(trace.config.block_size, "sha256")
    requests, outputs = [], []
    for item in trace.requests:
        prompt = trace.token_ids(item)[: trace.prompt_len(item)]
        requests.append(Request(item.req_id, prompt, SamplingParams(), block_hasher=hasher))
        outputs.append(item.output_token_ids)
    return requests, outputs


class Replay:
    """The replay rule; bench/peers/vllm_kv_cache_manager.py follows it line for line.

    Each step admits the head of the waiting queue when fewer than `max_running` run, then gives
    every running request one token: a finished one is freed, and a decode that does not fit
    preempts the youngest running request (possibly itself) to the front of the queue.
    """

    def __init__(
        self, manager: KVCacheManager, requests: list[Request], outputs: list[list[int]]
    ) -> None:
        self.manager, self.requests, self.outputs = manager, requests, outputs
        self.waiting, self.running = deque(range(len(requests))), []
        self.manager_s = 0.0
        self.num_hit_tokens = self.num_preemptions = self.num_allocations = self.num_failed = 0

    def run(self, max_running: int) -> ReplayResult:
        start = time.perf_counter()
        while self.waiting or self.running:
            if self.waiting and len(self.running) < max_running:
                self.admit_head()
            for idx in list(self.running):
                if idx in self.running:  # not preempted earlier in this step
                    self.decode(idx)
        replay_s = time.perf_counter() - start
        return ReplayResult(
            self.manager_s,
            replay_s,
            self.num_hit_tokens,
            self.num_preemptions,
            self.num_allocations,
            self.num_failed,
        )

    def admit_head(self) -> None:
        request = self.requests[self.waiting[0]]
        start = time.perf_counter()
        hits, num_hits = self.manager.get_computed_blocks(request)
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
        victim_idx = self.running.pop()
        victim = self.requests[victim_idx]
        self.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim_idx)
        return victim_idx

    def free(self, request: Request) -> None:
        start = time.perf_counter()
        self.manager.free(request)
        self.manager_s += time.perf_counter() - start


def run_kvserve(trace: Trace, repeats: int) -> tuple[list[ReplayResult], KVCacheManager]:
    config = trace.config
    spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=2, head_dim=16, dtype="float32"
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_gpu_blocks,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], spec=spec)],
    )
    results = []
    for _ in range(repeats):
        requests, outputs = build_requests(trace)
        manager = KVCacheManager(kv_cache_config, MAX_MODEL_LEN)
        results.append(Replay(manager, requests, outputs).run(config.max_running))
        if manager.block_pool.get_num_free_blocks() != config.num_gpu_blocks - 1:
            raise RuntimeError("blocks leaked: not every block is free after the replay")
    return results, manager


def _kvserve_figures(trace: Trace, results: list[ReplayResult]) -> dict[str, float | int | str]:
    """Counts from the first replay (every replay makes the same decisions), medians of times."""
    first = results[0]
    num_requests = len(trace.requests)
    manager_s = statistics.median(r.manager_s for r in results)
    return {
        "num_requests": num_requests,
        "num_hit_tokens": first.num_hit_tokens,
        "num_preemptions": first.num_preemptions,
        "num_allocations": first.num_allocations,
        "num_failed_allocations": first.num_failed_allocations,
        "manager_requests_per_s": num_requests / manager_s,
        "manager_us_per_request": manager_s / num_requests * 1e6,
        "replay_requests_per_s": num_requests / statistics.median(r.replay_s for r in results),
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=1000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    args = parser.parse_args()
    trace = make_trace(TraceConfig(seed=args.seed, num_requests=args.num_requests))
    results, _ = run_kvserve(trace, args.repeats)
    peer = None
    if args.peer:
        peer = run_peer(
            args.peer_python,
            PEER_SCRIPT,
            ["--trace-config", config_to_json(trace.config), "--repeats", str(args.repeats)],
        )
        _check_same_work(trace, results[0], peer)
        # As many runs again after the peer, so load drift on a shared machine hits both sides.
        results += run_kvserve(trace, args.repeats)[0]
    figures = _kvserve_figures(trace, results)
    if peer is not None:
        num_requests = len(trace.requests)
        figures["vllm_manager_requests_per_s"] = num_requests / peer["manager_s"]
        figures["vllm_replay_requests_per_s"] = num_requests / peer["replay_s"]
        figures["ratio_manager_vs_vllm"] = (
            figures["manager_requests_per_s"] / figures["vllm_manager_requests_per_s"]
        )
        figures["ratio_replay_vs_vllm"] = (
            figures["replay_requests_per_s"] / figures["vllm_replay_requests_per_s"]
        )
    report("KVCacheManager on the seeded serving trace", figures, args.json)


def _check_same_work(trace: Trace, result: ReplayResult, peer: dict) -> None:
    """Both sides replayed one trace and made the same decisions, or the ratio means nothing."""
    if peer["trace_digest"] != trace_digest(trace):
        raise SystemExit(f"trace digest {peer['trace_digest']} differs from {trace_digest(trace)}")
    for name in ("num_hit_tokens", "num_preemptions", "num_allocations", "num_failed_allocations"):
        if peer[name] != getattr(result, name):
            raise SystemExit(f"{name}: kvserve {getattr(result, name)}, vllm {peer[name]}")


if __name__ == "__main__":
    main()
