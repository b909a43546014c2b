"""The vLLM 0.33.0 side of bench/kv_cache_manager.py: the same trace through vLLM's KVCacheManager.

Runs under the peer interpreter and never imports kvserve; bench/trace.py (the identical trace)
and bench/replay.py (the identical loop) are standard library only. Prints one JSON object as its
last line: median seconds, the counts of what the replay did, and the trace digest; with
--decisions, one untimed replay's decisions (bench/manager_decisions.py) instead.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# importable thanks to the path above:
from bench.manager_decisions import RecordingManager
from bench.peers.vllm_kv_cache import sha256_request_block_hasher
from bench.replay import ManagerReplay, PrefillChunks
from bench.trace import Trace, config_from_json, make_trace, trace_digest

MAX_MODEL_LEN = 8192  # above the trace's longest sequence, so the cap never bites
# The layouts of bench/kv_cache_manager.py --spec, in tokens; kvserve's side builds the same.
SLIDING_WINDOW = 256
ATTENTION_CHUNK_SIZE = 1024
RSWA_WINDOW = 256
MAMBA_STATE_SHAPES = ((4, 64), (4, 8, 24))  # a 4096-byte float32 page, the attention page's
MAMBA_PREFILL_CHUNK_TOKENS = 512
LAYOUTS = (
    "full",
    "full+sliding",
    "full+chunked-local",
    "full+rswa",
    "full2x+sliding",
    "full2x+sliding16",
    "full+sliding2x",
    "full+mamba",
)


def layout_kv_cache_config(
    layout: str, block_size: int, num_blocks: int, retention_interval: int | None
) -> object:
    """Full attention (2 KV heads of 16, float32) as group 0, and the layout's second group."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": block_size, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    specs = [FullAttentionSpec(**shape)]
    if layout.startswith("full2x"):  # mixed block sizes: requests still hash at `block_size`
        specs = [FullAttentionSpec(**{**shape, "block_size": 2 * block_size})]
    if layout in ("full+sliding", "full2x+sliding"):
        specs.append(SlidingWindowSpec(**shape, sliding_window=SLIDING_WINDOW))
    elif layout == "full+sliding2x":  # the window's blocks twice the hashes'
        window_shape = {**shape, "block_size": 2 * block_size}
        specs.append(SlidingWindowSpec(**window_shape, sliding_window=SLIDING_WINDOW))
    elif layout == "full2x+sliding16":
        specs.append(SlidingWindowSpec(**shape, sliding_window=16))
    elif layout == "full+chunked-local":
        specs.append(ChunkedLocalAttentionSpec(**shape, attention_chunk_size=ATTENTION_CHUNK_SIZE))
    elif layout == "full+rswa":
        specs.append(RSWASpec(**shape, rswa_window=RSWA_WINDOW))
    elif layout == "full+mamba":
        dtypes = (torch.float32,) * len(MAMBA_STATE_SHAPES)
        mamba = MambaSpec(block_size, MAMBA_STATE_SHAPES, dtypes, mamba_cache_mode="align")
        specs.append(mamba)
    groups = [KVCacheGroupSpec([f"layer.{idx}"], spec) for idx, spec in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval,
    )


def keep_shared_prefix_boundary(manager: object) -> object:
    """Store each lookup's shared-prefix junction on the request, as vLLM's scheduler does (its
    window groups keep the blocks there under a retention interval); kvserve's manager keeps it
    itself. Only the lookup is wrapped, so allocation runs unwrapped."""
    lookup = manager.get_computed_blocks

    def get_computed_blocks(request: object) -> tuple:
        computed = lookup(request)
        request.shared_prefix_boundary = computed[2]
        return computed

    manager.get_computed_blocks = get_computed_blocks
    return manager


def layout_chunks(layout: str, block_size: int, manager: object) -> PrefillChunks | None:
    """vLLM's Scheduler._mamba_block_aligned_split where a layout has a Mamba group, read off a
    stand-in holding what a Scheduler derives for this config (align mode, hashes the size of
    every block, so no partial hits, no EAGLE, no checkpoint blocks inside a chunk), and the
    manager's per-step hook, which forgets the states cached by the step before."""
    if layout != "full+mamba":
        return None
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        block_size=block_size,
        hash_block_size=block_size,
        max_num_scheduled_tokens=MAMBA_PREFILL_CHUNK_TOKENS,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        mamba_partial_cache_hit=False,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,
    )

    def clip(request: object, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_hits = num_computed_tokens - request.num_computed_tokens
        return Scheduler._mamba_block_aligned_split(scheduler, request, num_new_tokens, num_hits)

    return PrefillChunks(clip, MAMBA_PREFILL_CHUNK_TOKENS, manager.new_step_starts)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace-config", required=True, help="TraceConfig as JSON")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spec", choices=LAYOUTS, default="full", help="KV-cache groups")
    parser.add_argument("--decisions", action="store_true", help="print one replay's decisions")
    parser.add_argument("--prefix-cache-retention-interval", type=int, help="tokens")
    args = parser.parse_args()

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    trace = make_trace(config_from_json(args.trace_config))
    config = trace.config
    block_hasher = sha256_request_block_hasher(config.block_size)
    kv_cache_config = layout_kv_cache_config(
        args.spec, config.block_size, config.num_gpu_blocks, args.prefix_cache_retention_interval
    )
    groups = kv_cache_config.kv_cache_groups

    def new_manager() -> object:
        manager = KVCacheManager(
            kv_cache_config,
            MAX_MODEL_LEN,
            scheduler_block_size=math.lcm(*(g.kv_cache_spec.block_size for g in groups)),
            hash_block_size=config.block_size,
            enable_caching=True,
            log_stats=False,
        )
        return keep_shared_prefix_boundary(manager)

    if args.decisions:
        requests, outputs = build_requests(trace, block_hasher)
        manager = new_manager()
        recorder = RecordingManager(manager, requests)
        chunks = layout_chunks(args.spec, config.block_size, manager)
        replay = ManagerReplay(recorder, requests, outputs, RequestStatus.PREEMPTED, chunks)
        replay.run(config.max_running)
        digest = trace_digest(trace)
        print(json.dumps({"decisions": recorder.decisions, "trace_digest": digest}))
        return
    results = []
    for _ in range(args.repeats):
        requests, outputs = build_requests(trace, block_hasher)
        manager = new_manager()
        chunks = layout_chunks(args.spec, config.block_size, manager)
        replay = ManagerReplay(manager, requests, outputs, RequestStatus.PREEMPTED, chunks)
        results.append(dataclasses.asdict(replay.run(config.max_running)))
    figures = dict(results[0])
    figures["manager_s"] = statistics.median(r["manager_s"] for r in results)
    figures["replay_s"] = statistics.median(r["replay_s"] for r in results)
    figures["trace_digest"] = trace_digest(trace)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
