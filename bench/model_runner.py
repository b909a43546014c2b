"""Benchmark of the worker's ModelRunner: tokens per second for both fake models at TP=1 and TP=2.

It also reports the share of each step's runner time spent outside the model forward (applying the
SchedulerOutput, batch building, slot mapping, context indices and sampling). Every rank runs
with one torch thread. Run: `python -m bench.model_runner [--repeats N] [--json FILE]`.
"""

import random
import statistics

import torch

from bench.report import base_parser, report
from bench.workload import RankResult, Workload, run_tensor_parallel
from protocol.kv_cache_spec import cdiv
from protocol.sampling import SamplingParams

MODELS = ("checksum", "tiny-llama")
TP_SIZES = (1, 2)
RANKS_TIMEOUT_S = 600.0


def make_workload(model: str, num_requests: int, prompt_len: int, output_len: int) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=output_len, ignore_eos=True)] * num_requests
    blocks_per_req = cdiv(prompt_len + output_len, 16)
    return Workload(
        model,
        block_size=16,
        num_blocks=1 + num_requests * blocks_per_req,
        prompts=prompts,
        sampling_params=params,
        max_num_batched_tokens=512,
        max_num_seqs=num_requests,
        enable_prefix_caching=False,  # every token is computed: a pure runner figure
    )


def measure(work: Workload, tp_size: int) -> dict[str, float]:
    """One run; the slowest rank's runner time sets the throughput."""
    results: list[RankResult] = run_tensor_parallel(work, tp_size, RANKS_TIMEOUT_S)
    slowest = max(results, key=lambda r: r.runner_s)
    generated = sum(len(tokens) for tokens in slowest.outputs.values())
    outside = slowest.prepare_s + slowest.sample_s
    return {
        "output_tokens_per_s": generated / slowest.runner_s,
        "scheduled_tokens_per_s": sum(slowest.step_tokens) / slowest.runner_s,
        "us_per_step": 1e6 * slowest.runner_s / slowest.num_steps,
        "outside_model_share": outside / slowest.runner_s,
        "prepare_share": slowest.prepare_s / slowest.runner_s,
        "sample_share": slowest.sample_s / slowest.runner_s,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same as each spawned rank
    figures: dict[str, float | int | str] = {}
    for model in MODELS:
        work = make_workload(model, args.num_requests, args.prompt_len, args.output_len)
        key = model.replace("-", "_")
        for tp_size in TP_SIZES:
            runs = [measure(work, tp_size) for _ in range(args.repeats)]
            for name in runs[0]:
                figures[f"{key}_tp{tp_size}_{name}"] = statistics.median(r[name] for r in runs)
        figures[f"ratio_{key}_tp2_to_tp1_output_tokens_per_s"] = (
            figures[f"{key}_tp2_output_tokens_per_s"] / figures[f"{key}_tp1_output_tokens_per_s"]
        )
    figures["workload"] = (
        f"{args.num_requests} requests x {args.prompt_len} prompt + {args.output_len} output "
        "tokens, block_size 16, 512 tokens per step, CPU, 1 thread per rank"
    )
    report("ModelRunner throughput (medians)", figures, args.json)


if __name__ == "__main__":
    main()
