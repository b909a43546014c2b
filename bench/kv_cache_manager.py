"""Requests per second through KVCacheManager on the seeded serving trace, against vLLM's.

A small continuous-batching loop over bench/trace.py (bench/replay.py's ManagerReplay, which the
peer, a fresh process per round of bench/peer_rounds.py, runs too); building the Requests (hashing
their prompts) stays out of the figures. `--spec` picks the KV-cache groups; with a peer, one
untimed replay first checks every decision (each request's hit length, each refused allocation)
against vLLM's and stops at the first that differs. Run: python -m bench.kv_cache_manager
[--spec LAYOUT] [--peer vllm [--rounds N]] [--json FILE]
"""

import dataclasses
import os
import statistics

from bench.manager_decisions import CheckingManager, DecisionMismatch
from bench.peer_rounds import Figures, PeerRatio, add_rounds_argument, run_rounds, summarize
from bench.replay import ManagerReplay, ManagerReplayResult, PrefillChunks
from bench.report import add_peer_arguments, base_parser, report, run_peer
from bench.trace import Trace, TraceConfig, config_to_json, make_trace, trace_digest
from engine_core.kv_cache.hashing import BlockHasher, get_group_id
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from engine_core.sched.block_aligned_chunks import BlockAlignedChunks
from engine_core.sched.request import Request, RequestStatus
from protocol.sampling import SamplingParams

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_kv_cache_manager.py")
MAX_MODEL_LEN = 8192  # above the trace's longest sequence, so the cap never bites
# The layouts of --spec, in tokens; bench/peers/vllm_kv_cache_manager.py builds the same.
SLIDING_WINDOW = 256
ATTENTION_CHUNK_SIZE = 1024
RSWA_WINDOW = 256
# full2x+sliding: full attention's blocks twice the trace's, the window's the trace's (mixed
# block sizes: requests hash at the smaller, hits end on the larger); full2x+sliding16 the same
# with a 16-token window, which a hit reads from one window block.
# full+sliding2x: the other way round, the window's blocks twice the trace's (full 16 + window 32
# by default), so full attention reads the request's own hashes and the window group a view.
# full+mamba: a Mamba group in align mode beside full attention, both in the trace's blocks (16).
# Real hybrid models enlarge the attention block until its page matches the state's; here the
# state is sized to the attention page instead (2 x 16 tokens x 2 heads x 16 x 4 B = 4096 B =
# (4*64 + 4*8*24) float32 values), valid on both sides. Prefills run in chunks of at most
# MAMBA_PREFILL_CHUNK_TOKENS, each side's scheduler rule ending them where states are kept.
MAMBA_STATE_SHAPES = ((4, 64), (4, 8, 24))
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
# R-SWA: a pool where no request is preempted. A resumed request would hit its own generated
# blocks in vLLM, which caches them; kvserve caches only an R-SWA group's prompt blocks (a
# generated token's K/V depends on where its prompt ended) and caps the hit at the prompt.
# full+mamba: one where no request is preempted either (4096 blocks on the default trace, which
# still evicts). A refused allocation frees a Mamba group's skipped state block in vLLM and changes
# nothing in kvserve (DESIGN.md 3.4: allocate_slots returning None changes no ref count), so
# under preemption the two free queues fill in different orders and later evictions differ.
NUM_GPU_BLOCKS_BY_LAYOUT = {"full+rswa": 24576, "full+mamba": 4096}
PEER_ROUND_REPEATS = 3  # replays per side per round; the rounds give the ratio's median
TITLE = "KVCacheManager on the seeded serving trace (ratios: ours over vLLM's requests per second)"
WORK_COUNTS = ("num_hit_tokens", "num_preemptions", "num_allocations", "num_failed_allocations")
RATIOS = [
    PeerRatio("ratio_manager_vs_vllm", "manager_requests_per_s", is_ours_over_peer=True),
    PeerRatio("ratio_replay_vs_vllm", "replay_requests_per_s", is_ours_over_peer=True),
]


def build_requests(trace: Trace) -> tuple[list[Request], list[list[int]]]:
    hasher = BlockHasher(trace.config.block_size, "sha256")
    requests, outputs = [], []
    for item in trace.requests:
        prompt = trace.token_ids(item)[: trace.prompt_len(item)]
        requests.append(Request(item.req_id, prompt, SamplingParams(), block_hasher=hasher))
        outputs.append(item.output_token_ids)
    return requests, outputs


def layout_kv_cache_config(layout: str, block_size: int, num_blocks: int) -> KVCacheConfig:
    """Full attention (2 KV heads of 16, float32) as group 0, and the layout's second group."""
    shape = {"block_size": block_size, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    specs: list[KVCacheSpec] = [FullAttentionSpec(**shape)]
    if layout.startswith("full2x"):
        specs = [FullAttentionSpec(**{**shape, "block_size": 2 * block_size})]
    match layout:
        case "full+sliding" | "full2x+sliding":
            specs.append(SlidingWindowSpec(**shape, sliding_window=SLIDING_WINDOW))
        case "full+sliding2x":
            window_shape = {**shape, "block_size": 2 * block_size}
            specs.append(SlidingWindowSpec(**window_shape, sliding_window=SLIDING_WINDOW))
        case "full2x+sliding16":
            specs.append(SlidingWindowSpec(**shape, sliding_window=16))
        case "full+chunked-local":
            specs.append(
                ChunkedLocalAttentionSpec(**shape, attention_chunk_size=ATTENTION_CHUNK_SIZE)
            )
        case "full+rswa":
            specs.append(RSWASpec(**shape, rswa_window=RSWA_WINDOW))
        case "full+mamba":
            specs.append(MambaSpec(block_size, MAMBA_STATE_SHAPES, "float32", "align"))
    groups = [KVCacheGroupSpec([f"layer.{idx}"], spec) for idx, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def layout_chunks(layout: str, manager: KVCacheManager) -> PrefillChunks | None:
    """The scheduler's block-aligned prefill chunks where a layout has a Mamba group, each
    stopping short of its request's junction too (see keep_shared_prefix_boundaries)."""
    if layout != "full+mamba":
        return None
    junctions = keep_shared_prefix_boundaries(manager)
    block_size = manager.coordinator.single_type_managers[1].block_size
    aligned = BlockAlignedChunks(block_size, MAMBA_PREFILL_CHUNK_TOKENS)

    def clip(request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        junction = junctions.get(request.req_id, 0)
        return aligned.clip(request, num_computed_tokens, num_new_tokens, junction)

    return PrefillChunks(clip, MAMBA_PREFILL_CHUNK_TOKENS)


def keep_shared_prefix_boundaries(manager: KVCacheManager) -> dict[str, int]:
    """Each request's junction from its last lookup (how far full attention hit past the agreed
    hit, else 0), which kvserve's KVCacheManager reports beside an align-mode Mamba group and its
    Scheduler hands to BlockAlignedChunks; vLLM's lookup returns it and its Scheduler keeps it
    on the request. Only the lookup is wrapped, so allocation runs unwrapped."""
    lookup, junctions = manager.get_computed_blocks, {}

    def get_computed_blocks(request: Request) -> tuple:
        computed = lookup(request)
        junctions[request.req_id] = computed[0].shared_prefix_boundary
        return computed

    manager.get_computed_blocks = get_computed_blocks
    return junctions


def check_decisions(
    trace: Trace, layout: str, expected: list[list], retention_interval: int | None = None
) -> int:
    """Replay once, comparing every decision with vLLM's as it is made; the number checked."""
    config = trace.config
    requests, outputs = build_requests(trace)
    kv_cache_config = layout_kv_cache_config(layout, config.block_size, config.num_gpu_blocks)
    manager = KVCacheManager(
        kv_cache_config, MAX_MODEL_LEN, prefix_cache_retention_interval=retention_interval
    )
    checker = CheckingManager(
        manager,
        requests,
        [(kind, idx, num) for kind, idx, num in expected],
    )
    chunks = layout_chunks(layout, manager)
    replay = ManagerReplay(checker, requests, outputs, RequestStatus.PREEMPTED, chunks)
    try:
        replay.run(config.max_running)
        checker.check_complete()
    except DecisionMismatch as exc:
        raise SystemExit(f"--spec {layout}: {exc}") from None
    return len(checker.decisions)


def run_kvserve(
    trace: Trace, repeats: int, layout: str = "full", retention_interval: int | None = None
) -> tuple[list[ManagerReplayResult], KVCacheManager]:
    config = trace.config
    kv_cache_config = layout_kv_cache_config(layout, config.block_size, config.num_gpu_blocks)
    results = []
    for _ in range(repeats):
        requests, outputs = build_requests(trace)
        manager = KVCacheManager(
            kv_cache_config, MAX_MODEL_LEN, prefix_cache_retention_interval=retention_interval
        )
        chunks = layout_chunks(layout, manager)
        replay = ManagerReplay(manager, requests, outputs, RequestStatus.PREEMPTED, chunks)
        results.append(replay.run(config.max_running))
        if manager.block_pool.get_num_free_blocks() != config.num_gpu_blocks - 1:
            raise RuntimeError("blocks leaked: not every block is free after the replay")
    return results, manager


def _kvserve_figures(trace: Trace, results: list[ManagerReplayResult]) -> Figures:
    """Counts from the first replay (every replay makes the same decisions), medians of times."""
    first = results[0]
    manager_s = statistics.median(r.manager_s for r in results)
    figures: Figures = {"num_requests": len(trace.requests)}
    figures.update({name: getattr(first, name) for name in WORK_COUNTS})
    figures.update(
        _rates(len(trace.requests), manager_s, statistics.median(r.replay_s for r in results))
    )
    return figures


def _indexed_blocks(manager: KVCacheManager) -> Figures:
    """Prefix-cache entries per group left after the replay (all requests done)."""
    counts = [0] * manager.num_kv_cache_groups
    for block in manager.block_pool.blocks:
        if block.block_hash is not None:
            counts[get_group_id(block.block_hash)] += 1
    return {f"num_indexed_blocks_group_{idx}": count for idx, count in enumerate(counts)}


def _rates(num_requests: int, manager_s: float, replay_s: float) -> Figures:
    return {
        "manager_requests_per_s": num_requests / manager_s,
        "manager_us_per_request": manager_s / num_requests * 1e6,
        "replay_requests_per_s": num_requests / replay_s,
    }


def _peer_figures(trace: Trace, peer: dict) -> Figures:
    """The peer's round in our figures' names, its counts and trace digest kept for the check."""
    figures: Figures = {name: peer[name] for name in (*WORK_COUNTS, "trace_digest")}
    figures.update(_rates(len(trace.requests), peer["manager_s"], peer["replay_s"]))
    return figures


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    add_rounds_argument(parser)
    parser.add_argument("--num-requests", type=int, default=1000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--spec", choices=LAYOUTS, default="full", help="the KV-cache groups")
    parser.add_argument("--num-gpu-blocks", type=int, help="blocks in the pool (default by --spec)")
    parser.add_argument(
        "--prefix-cache-retention-interval",
        type=int,
        help="tokens; thins the window group's prefix-cache entries (full+sliding only)",
    )
    parser.set_defaults(repeats=PEER_ROUND_REPEATS)
    args = parser.parse_args()
    num_gpu_blocks = args.num_gpu_blocks or NUM_GPU_BLOCKS_BY_LAYOUT.get(args.spec)
    trace_config = TraceConfig(seed=args.seed, num_requests=args.num_requests)
    if num_gpu_blocks:
        trace_config = dataclasses.replace(trace_config, num_gpu_blocks=num_gpu_blocks)
    trace = make_trace(trace_config)
    retention_interval = args.prefix_cache_retention_interval
    title = f"{TITLE}, --spec {args.spec}"
    layout_figures: Figures = {"spec": args.spec}
    peer_args = ["--trace-config", config_to_json(trace.config), "--spec", args.spec]
    if retention_interval is not None:
        title += f", retention interval {retention_interval}"
        layout_figures["prefix_cache_retention_interval"] = retention_interval
        peer_args += ["--prefix-cache-retention-interval", str(retention_interval)]

    def measure_ours() -> Figures:
        results, manager = run_kvserve(trace, args.repeats, args.spec, retention_interval)
        return {**_kvserve_figures(trace, results), **_indexed_blocks(manager)}

    if not args.peer:
        report(title, {**layout_figures, **measure_ours()}, args.json)
        return
    recorded = run_peer(args.peer_python, PEER_SCRIPT, [*peer_args, "--decisions"])
    num_checked = check_decisions(trace, args.spec, recorded["decisions"], retention_interval)
    peer_args += ["--repeats", str(args.repeats)]
    rounds = run_rounds(
        args.rounds,
        measure_ours,
        lambda: _peer_figures(trace, run_peer(args.peer_python, PEER_SCRIPT, peer_args)),
        lambda ours, peer: _check_same_work(trace, ours, peer),
    )
    peer_keys = ["manager_requests_per_s", "replay_requests_per_s"]
    figures = {**layout_figures, "num_decisions_checked": num_checked}
    report(title, {**figures, **summarize(rounds, RATIOS, peer_keys)}, args.json)


def _check_same_work(trace: Trace, ours: Figures, peer: Figures) -> None:
    """Both sides replayed one trace and made the same decisions, or the ratio means nothing."""
    if peer["trace_digest"] != trace_digest(trace):
        raise SystemExit(f"trace digest {peer['trace_digest']} differs from {trace_digest(trace)}")
    for name in WORK_COUNTS:
        if peer[name] != ours[name]:
            raise SystemExit(f"{name}: kvserve {ours[name]}, vllm {peer[name]}")


if __name__ == "__main__":
    main()
