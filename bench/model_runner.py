"""Benchmark of the worker's ModelRunner: tokens per second for both fake models at TP=1 and TP=2.

It also reports the share of each step's runner time spent outside the model forward (applying the
SchedulerOutput, batch building, slot mapping, context indices and sampling). Every rank runs
with one torch thread. Run: `python -m bench.model_runner [--repeats N] [--json FILE]`;
`--cascade` instead measures tiny-llama with a long prefix every request shares, cascade
attention on and off, alternating over the rounds.
"""

import argparse
import random
import statistics

import torch

from bench.report import base_parser, report
from bench.workload import (
    RankResult,
    Workload,
    build_rank,
    run_tensor_parallel,
    run_to_completion,
)
from protocol.kv_cache_spec import cdiv
from protocol.sampling import SamplingParams
from worker.distributed import single_rank_group

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


def make_shared_prefix_workload(
    num_requests: int, prefix_len: int, tail_len: int, output_len: int
) -> Workload:
    """Requests that share a `prefix_len`-token prompt head, each with its own tail."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    prompts = [
        prefix + [rng.randrange(3, 500) for _ in range(tail_len)] for _ in range(num_requests)
    ]
    params = [SamplingParams(max_tokens=output_len, ignore_eos=True)] * num_requests
    unique_blocks = cdiv(tail_len + output_len, 16) + 1
    return Workload(
        "tiny-llama",
        block_size=16,
        num_blocks=1 + cdiv(prefix_len, 16) + num_requests * unique_blocks,
        prompts=prompts,
        sampling_params=params,
        max_num_batched_tokens=512,
        max_num_seqs=num_requests,
        enable_prefix_caching=True,  # the shared head is computed once and then hit
    )


def measure_cascade(work: Workload, is_enabled: bool) -> tuple[float, int, dict[int, list[int]]]:
    """One TP=1 run: (output tokens per second of runner time, cascade steps, tokens)."""
    core, executor = build_rank(work, single_rank_group(), torch.device("cpu"))
    executor.runner.enable_cascade_attention = is_enabled
    outputs = run_to_completion(core)
    generated = sum(len(tokens) for tokens in outputs.values())
    return generated / executor.runner_s, executor.runner.num_cascade_steps, outputs


def cascade_figures(args: argparse.Namespace) -> dict[str, float | int | str]:
    """Cascade on and off alternate (on, off, on, off...); ratios are per round, then median."""
    work = make_shared_prefix_workload(
        args.num_requests, args.shared_prefix_len, args.tail_len, args.output_len
    )
    on_rates, off_rates, num_cascade_steps = [], [], 0
    for _ in range(max(5, args.repeats)):
        on_rate, num_cascade_steps, on_tokens = measure_cascade(work, True)
        off_rate, _, off_tokens = measure_cascade(work, False)
        if on_tokens != off_tokens:
            raise RuntimeError("cascade attention changed the tokens")
        on_rates.append(on_rate)
        off_rates.append(off_rate)
    rounds = [on / off for on, off in zip(on_rates, off_rates, strict=True)]
    return {
        "cascade_on_output_tokens_per_s": statistics.median(on_rates),
        "cascade_off_output_tokens_per_s": statistics.median(off_rates),
        "ratio_cascade_on_to_off_output_tokens_per_s": statistics.median(rounds),
        "cascade_steps_per_run": num_cascade_steps,
        "workload": (
            f"tiny-llama, {args.num_requests} requests x ({args.shared_prefix_len} shared + "
            f"{args.tail_len} own) prompt tokens + {args.output_len} output, block_size 16, "
            "prefix caching on, 512 tokens per step, TP=1, CPU, 1 thread"
        ),
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--cascade", action="store_true", help="measure cascade attention on vs off instead"
    )
    parser.add_argument(
        "--shared-prefix-len", type=int, default=1024, help="tokens every prompt shares (--cascade)"
    )
    parser.add_argument(
        "--tail-len", type=int, default=16, help="tokens of each prompt's own tail (--cascade)"
    )
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same as each spawned rank
    if args.cascade:
        report("Cascade attention, tiny-llama (medians)", cascade_figures(args), args.json)
        return
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
