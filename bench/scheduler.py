"""Microseconds per schedule() plus update_from_output(), against vLLM's Scheduler on one workload.

Workloads (bench/scheduler_workloads.py, run alike by both sides): 64, 256 and 1,024 running
decodes, and a prefill-heavy mix (new 768-token prompts every step beside the decodes). Building
runner outputs and adding requests stay out of the figures. The peer runs in a fresh process per
round of bench/peer_rounds.py. Run: `python -m bench.scheduler --peer vllm [--rounds N]`.
"""

import argparse
import os
import time
from array import array

from bench.peer_rounds import Figures, PeerRatio, add_rounds_argument, run_rounds, summarize
from bench.report import add_peer_arguments, base_parser, report, run_peer
from bench.scheduler_workloads import (
    SAMPLED_TOKEN_ID,
    VOCAB_SIZE,
    add_workload_arguments,
    measure_workloads,
    workload_keys,
)
from engine_core.sched.scheduler import Scheduler
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.config import CacheConfig, SchedulerConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelInfo, ModelRunnerOutput

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_scheduler.py")
PEER_ROUND_REPEATS = 3  # step windows per workload per side per round
TITLE = "scheduler: µs per schedule() + update_from_output() (ratios: vLLM's time over ours)"


class KvserveBench:
    """One kvserve Scheduler, fed requests and driven with fake runner outputs."""

    def __init__(self, args: argparse.Namespace) -> None:
        group = KVCacheGroupSpec(["layer.0"], FullAttentionSpec(args.block_size, 2, 16, "float32"))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                async_scheduling=False,  # one step in flight, as the peer's loop runs it
            ),
            CacheConfig(block_size=args.block_size),
            KVCacheConfig(args.num_blocks, [group]),
            ModelInfo("bench", VOCAB_SIZE, [], args.max_model_len, [group]),
        )
        self.num_added = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        request = EngineCoreRequest(
            f"req-{self.num_added}",
            pack_int32(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            float(self.num_added),
        )
        self.num_added += 1
        rejection = self.scheduler.add_request(request, b"bench")
        if rejection is not None:
            raise RuntimeError(f"benchmark request rejected: {rejection.outputs[0].error}")

    def step(self) -> float:
        """Seconds of schedule() plus update_from_output(); the runner output is not timed."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduled_s = time.perf_counter() - start
        handles = array("i", [new.handle for new in scheduler_output.scheduled_new_reqs])
        handles.extend(unpack_int32(scheduler_output.scheduled_cached_reqs.handles))
        runner_output = ModelRunnerOutput(
            scheduler_output.step_id,
            0,
            pack_int32(handles),
            pack_int32(array("i", [SAMPLED_TOKEN_ID]) * len(handles)),
        )
        start = time.perf_counter()
        self.scheduler.update_from_output(scheduler_output, runner_output)
        return scheduled_s + time.perf_counter() - start


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    add_rounds_argument(parser)
    add_workload_arguments(parser)
    parser.set_defaults(repeats=PEER_ROUND_REPEATS)
    args = parser.parse_args()

    def measure_ours() -> Figures:
        return measure_workloads(lambda: KvserveBench(args), args)

    if args.peer != "vllm":
        report(TITLE, measure_ours(), args.json)
        return
    peer_args = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in workload_keys()]
    rounds = run_rounds(
        args.rounds,
        measure_ours,
        lambda: run_peer(args.peer_python, PEER_SCRIPT, peer_args),
        check_same_work,
    )
    keys = list(rounds[0].ours)
    ratios = [
        PeerRatio(f"ratio_{key}", key, is_ours_over_peer=False)
        for key in keys
        if key.endswith("_us_per_step")
    ]
    report(TITLE, summarize(rounds, ratios, keys), args.json)


def check_same_work(ours: Figures, peer: Figures) -> None:
    """Both sides ran the same workloads and the prefill mix ended with as many requests running."""
    if set(peer) != set(ours):
        raise SystemExit(f"the vLLM peer reported {sorted(peer)}, kvserve {sorted(ours)}")
    key = "prefill_mix_num_running_reqs"
    if peer[key] != ours[key]:
        raise SystemExit(f"{key}: kvserve {ours[key]}, vLLM {peer[key]}")


if __name__ == "__main__":
    main()
