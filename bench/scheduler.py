"""Microseconds per schedule() plus update_from_output(), against vLLM's Scheduler on one workload.

Workloads: 64, 256 and 1,024 running decode requests, and a prefill-heavy mix (new 768-token
prompts every step beside the running decodes). Building the fake runner output and adding
requests stay out of the figures; bench/scheduler_workloads.py holds the loops both sides run.
Run: `python -m bench.scheduler --peer vllm`.
"""

import argparse
import os
import time
from array import array

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


class KvserveBench:
    """One kvserve Scheduler, fed requests and driven with fake runner outputs."""

    def __init__(self, args: argparse.Namespace) -> None:
        group = KVCacheGroupSpec(["layer.0"], FullAttentionSpec(args.block_size, 2, 16, "float32"))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
            ),
            CacheConfig(block_size=args.block_size),
            KVCacheConfig(args.num_blocks, [group]),
            ModelInfo("bench", VOCAB_SIZE, None, args.max_model_len, [group]),
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
    add_workload_arguments(parser)
    args = parser.parse_args()
    figures: dict[str, float | int | str] = {}
    figures.update(measure_workloads(lambda: KvserveBench(args), args))
    if args.peer == "vllm":
        _add_peer_figures(figures, args)
    report("scheduler: µs per schedule() + update_from_output()", figures, args.json)


def _add_peer_figures(figures: dict[str, float | int | str], args: argparse.Namespace) -> None:
    """Run the same workloads through vLLM; `ratio_*` is vLLM's time over ours (> 1: faster)."""
    peer_args = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in workload_keys()]
    peer = run_peer(args.peer_python, PEER_SCRIPT, peer_args)
    own_keys = list(figures)
    for key in own_keys:
        figures[f"vllm_{key}"] = peer[key]
    for key in own_keys:
        if key.endswith("_us_per_step"):
            figures[f"ratio_{key}"] = peer[key] / figures[key]


if __name__ == "__main__":
    main()
