"""Microseconds per schedule() plus update_from_output(), against vLLM's Scheduler on one workload.

Workloads: 64, 256 and 1,024 running decode requests, and a prefill-heavy mix (new 768-token
prompts every step beside the running decodes). Building the fake runner output and adding
requests stay out of the figures on both sides. Run: `python -m bench.scheduler --peer vllm`.
"""

import argparse
import os
import random
import statistics
import time
from array import array
from collections.abc import Callable

from bench.report import add_peer_arguments, base_parser, report, run_peer
from engine_core.sched.scheduler import Scheduler
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.config import CacheConfig, SchedulerConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelInfo, ModelRunnerOutput

SAMPLED_TOKEN_ID = 7  # every step samples this; ignore_eos keeps requests going
VOCAB_SIZE = 512
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "peers", "vllm_scheduler.py")
SHARED_FLAGS = [
    ("--max-num-seqs", 1024),
    ("--max-num-batched-tokens", 8192),
    ("--max-model-len", 4096),
    ("--block-size", 16),
    ("--num-blocks", 40000),
    ("--prompt-len", 32),
    ("--steps", 50),
    ("--mix-arrivals", 10),
    ("--mix-prompt-len", 768),
    ("--mix-warmup-steps", 30),
]


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
        handles = array("i", [new.req_id for new in scheduler_output.scheduled_new_reqs])
        handles.extend(unpack_int32(scheduler_output.scheduled_cached_reqs.req_ids))
        runner_output = ModelRunnerOutput(
            scheduler_output.step_id,
            0,
            pack_int32(handles),
            pack_int32(array("i", [SAMPLED_TOKEN_ID]) * len(handles)),
        )
        start = time.perf_counter()
        self.scheduler.update_from_output(scheduler_output, runner_output)
        return scheduled_s + time.perf_counter() - start

    def num_decoding(self) -> int:
        return sum(1 for request in self.scheduler.running if request.num_output_tokens > 0)


def decode_workload(bench: KvserveBench, num_reqs: int, args: argparse.Namespace) -> float:
    rng = random.Random(num_reqs)
    max_tokens = args.steps * args.repeats + 64
    for _ in range(num_reqs):
        bench.add([rng.randrange(1, VOCAB_SIZE) for _ in range(args.prompt_len)], max_tokens)
    while bench.num_decoding() < num_reqs:
        bench.step()
    return _median_us(bench, args, lambda: None)


def prefill_mix_workload(bench: KvserveBench, args: argparse.Namespace) -> tuple[float, int]:
    """µs per step, and the running requests at the end (equal on both sides when in step)."""
    rng = random.Random(12345)

    def arrive() -> None:
        for _ in range(args.mix_arrivals):
            bench.add([rng.randrange(1, VOCAB_SIZE) for _ in range(args.mix_prompt_len)], 16)

    for _ in range(args.mix_warmup_steps):
        arrive()
        bench.step()
    return _median_us(bench, args, arrive), len(bench.scheduler.running)


def _median_us(bench: KvserveBench, args: argparse.Namespace, arrive: Callable[[], None]) -> float:
    """Median over `repeats` windows of the mean step time of `steps` steps, in µs."""
    windows = []
    for _ in range(args.repeats):
        total_s = 0.0
        for _ in range(args.steps):
            arrive()
            total_s += bench.step()
        windows.append(total_s / args.steps * 1e6)
    return statistics.median(windows)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    add_peer_arguments(parser)
    for flag, default in SHARED_FLAGS:
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--decode-sizes", default="64,256,1024", help="running decode requests")
    args = parser.parse_args()
    figures: dict[str, float | int | str] = {}
    for num_reqs in [int(size) for size in args.decode_sizes.split(",")]:
        figures[f"decode_{num_reqs}_us_per_step"] = decode_workload(
            KvserveBench(args), num_reqs, args
        )
    mix_us, mix_running = prefill_mix_workload(KvserveBench(args), args)
    figures["prefill_mix_us_per_step"] = mix_us
    figures["prefill_mix_num_running_reqs"] = mix_running
    if args.peer == "vllm":
        _add_peer_figures(figures, args)
    report("scheduler: µs per schedule() + update_from_output()", figures, args.json)


def _add_peer_figures(figures: dict[str, float | int | str], args: argparse.Namespace) -> None:
    """Run the same workloads through vLLM; `ratio_*` is vLLM's time over ours (> 1: faster)."""
    peer_args = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in _peer_keys()]
    peer = run_peer(args.peer_python, PEER_SCRIPT, peer_args)
    own_keys = list(figures)
    for key in own_keys:
        figures[f"vllm_{key}"] = peer[key]
    for key in own_keys:
        if key.endswith("_us_per_step"):
            figures[f"ratio_{key}"] = peer[key] / figures[key]


def _peer_keys() -> list[str]:
    return [flag[2:].replace("-", "_") for flag, _ in SHARED_FLAGS] + ["repeats", "decode_sizes"]


if __name__ == "__main__":
    main()
