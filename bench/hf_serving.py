"""kvserve serving a real checkpoint beside transformers on the same prompts: output tokens per
second and TTFT, in interleaved rounds, with every side's greedy tokens required to be identical.

Sides: kvserve (`kvserve launch --model DIR`, its own continuous batching over the paged cache,
through the ZeroMQ client), transformers' `generate_batch` continuous batching (per-request
lengths, its start-up included), and batched `generate()` (one static batch, left-padded to the
longest prompt, run to the longest output). Workloads: `mixed` (prompt and output lengths vary,
prompts share system prefixes, as serving sees them) and `equal` (`generate()`'s best case).
Run: `python -m bench.hf_serving [--model DIR | --arch qwen3-moe] [--rounds 5] [--json FILE]`
(without --model it makes a random checkpoint of --arch and --shape). `--decode-sweep`
instead times one rank's decode step in-process at batch sizes 8 to 64 (the cost per step that
a draining batch keeps paying).
"""

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.make_checkpoint import ARCHS, MOE_ARCHS, SHAPES, CheckpointSpec, make_checkpoint
from bench.peer_rounds import MIN_ROUNDS, num_rounds
from bench.report import report, unwind_on_sigterm
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.sampling import SamplingParams

SIDES = ("kvserve", "generate_batch", "generate")
WORKLOADS = ("mixed", "equal")
NUM_SYSTEM_PROMPTS = 4  # the mixed workload's shared prefixes
SYSTEM_PROMPT_TOKENS = 64
MIXED_SUFFIX_TOKENS = (16, 192)  # each mixed prompt's own tokens after its system prompt
MIXED_OUTPUT_TOKENS = (16, 128)
EQUAL_PROMPT_TOKENS = 128
EQUAL_SHARED_TOKENS = 96
EQUAL_OUTPUT_TOKENS = 64
FIRST_PROMPT_ID = 3  # prompt ids are drawn past the checkpoint maker's special tokens
STARTUP_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 1800.0
STOP_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 1.0
MIN_TOP2_MARGIN = 1e-3  # logits; a greedy pick nearer a tie than this may differ between sides
KV_CACHE_MEMORY_BYTES = 1 << 30  # per rank: every workload's requests fit at once


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # each request's output length (EOS ignored on every side)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(frozen=True, slots=True)
class SideResult:
    """One side's run of one workload."""

    tokens: list[list[int]]  # per request, its generated ids
    ttft_s: list[float]  # per request, from the run's start to its first token
    wall_s: float  # from the run's start to the last token
    forward_s: float | None = None  # kvserve: the least busy rank's seconds in the forward
    margins: list[list[float]] | None = None  # generate(): per request, each step's top-2 margin

    def figures(self, prefix: str, num_output_tokens: int) -> dict[str, float]:
        ttft_ms = sorted(1000 * value for value in self.ttft_s)
        figures = {
            f"{prefix}_output_tokens_per_s": num_output_tokens / self.wall_s,
            f"{prefix}_ttft_p50_ms": statistics.median(ttft_ms),
            f"{prefix}_ttft_p99_ms": ttft_ms[min(len(ttft_ms) - 1, int(0.99 * len(ttft_ms)))],
        }
        if self.forward_s is not None:  # the share of the rank's wall time the model takes
            figures[f"{prefix}_forward_share"] = self.forward_s / self.wall_s
        return figures


def make_workload(name: str, num_requests: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(count)]

    if name == "equal":
        shared = ids(EQUAL_SHARED_TOKENS)
        prompts = [
            shared + ids(EQUAL_PROMPT_TOKENS - EQUAL_SHARED_TOKENS) for _ in range(num_requests)
        ]
        return Workload(name, prompts, [EQUAL_OUTPUT_TOKENS] * num_requests)
    systems = [ids(SYSTEM_PROMPT_TOKENS) for _ in range(NUM_SYSTEM_PROMPTS)]
    prompts = [
        rng.choice(systems) + ids(rng.randint(*MIXED_SUFFIX_TOKENS)) for _ in range(num_requests)
    ]
    max_tokens = [rng.randint(*MIXED_OUTPUT_TOKENS) for _ in range(num_requests)]
    return Workload(name, prompts, max_tokens)


class StepRecorder:
    """A logits processor that records when `generate()` first samples (the static batch's TTFT)
    and each step's top-2 logit margin per row (where float noise may flip a greedy pick)."""

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.margins: list[torch.Tensor] = []  # per step, [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_s is None:
            self.first_s = time.perf_counter()
        top2 = scores.float().topk(2, dim=-1).values
        self.margins.append(top2[:, 0] - top2[:, 1])
        return scores


def run_generate(model: torch.nn.Module, workload: Workload, pad_id: int) -> SideResult:
    import transformers

    longest = max(len(prompt) for prompt in workload.prompts)
    rows = [[pad_id] * (longest - len(p)) + p for p in workload.prompts]  # left padding
    masks = [[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts]
    recorder = StepRecorder()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(rows),
            attention_mask=torch.tensor(masks),
            max_new_tokens=max(workload.max_tokens),
            do_sample=False,
            # as a keyword: a GenerationConfig's None lets the checkpoint's generation config
            # fill its EOS ids back in, and a row that samples one would be padded from there
            eos_token_id=None,
            pad_token_id=pad_id,
            logits_processor=transformers.LogitsProcessorList([recorder]),
        )
    wall_s = time.perf_counter() - start
    generated = out[:, longest:].tolist()
    tokens = [row[:n] for row, n in zip(generated, workload.max_tokens, strict=True)]
    ttft_s = (recorder.first_s or start) - start
    margins = torch.stack(recorder.margins, dim=1).tolist()  # [B, steps]
    return SideResult(tokens, [ttft_s] * len(tokens), wall_s, margins=margins)


def run_generate_batch(model: torch.nn.Module, workload: Workload, pad_id: int) -> SideResult:
    import transformers

    config = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    start = time.perf_counter()
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            ids = [
                manager.add_request(prompt, max_new_tokens=n, record_timestamps=True)
                for prompt, n in zip(workload.prompts, workload.max_tokens, strict=True)
            ]
            results = {}
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while len(results) < len(ids):
                if time.monotonic() > deadline or not manager.is_running():
                    raise RuntimeError(f"generate_batch finished {len(results)} of {len(ids)}")
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
        finally:
            manager.stop(block=True, timeout=STOP_TIMEOUT_S)
    wall_s = time.perf_counter() - start
    ordered = [results[req_id] for req_id in ids]
    ttft_s = [result.timestamps[0] - start for result in ordered]
    return SideResult([list(r.generated_tokens) for r in ordered], ttft_s, wall_s)


def run_kvserve(client: EngineClient, workload: Workload) -> SideResult:
    client.reset_prefix_cache()  # each round starts cold, as the other sides do
    forward_before_s = float(client.get_stats()["rank_forward_s"])  # type: ignore[index]
    start = time.monotonic()
    req_ids = []
    for idx, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        req_id = f"{workload.name}-{idx}-{time.monotonic_ns()}"
        client.add_request(make_request(req_id, prompt, params))
        req_ids.append(req_id)
    client.run_until_finished(req_ids, timeout_s=RUN_TIMEOUT_S)
    results = [client.result(req_id) for req_id in req_ids]
    failed = [r for r in results if r.finish_reason != "length"]
    if failed:
        raise RuntimeError(f"{failed[0].req_id} ended {failed[0].finish_reason}: {failed[0].error}")
    wall_s = max(r.finish_time or start for r in results) - start
    ttft_s = [(r.first_token_time or start) - start for r in results]
    forward_s = float(client.get_stats()["rank_forward_s"]) - forward_before_s  # type: ignore[index]
    return SideResult([r.token_ids for r in results], ttft_s, wall_s, forward_s)


def start_kvserve(model_dir: Path, folder: Path, tp_size: int, threads: int) -> subprocess.Popen:
    (master_port,) = free_tcp_ports(1)
    command = [str(Path(sys.executable).parent / "kvserve"), "launch", "--model", str(model_dir)]
    command += ["-tp", str(tp_size), "--master-port", str(master_port), "--device", "cpu"]
    # a set pool, so the default (half of the host's free memory) leaves transformers its own
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)]
    command += ["--client-address", f"ipc://{folder}/client.sock"]
    command += ["--worker-address", f"ipc://{folder}/worker.sock", "--log-level", "WARNING"]
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, threads // tp_size))}
    return subprocess.Popen(command, env=env, start_new_session=True)


def wait_ready(client: EngineClient, launcher: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if launcher.poll() is not None:
            raise RuntimeError(f"kvserve launch exited with {launcher.returncode} at startup")
        try:
            client.call_utility("check_health", timeout_s=HEALTH_TIMEOUT_S)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvserve not ready in {STARTUP_TIMEOUT_S} s") from None


def stop_kvserve(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(STOP_TIMEOUT_S)


def compare_greedy(ours: SideResult, theirs: SideResult, reference: SideResult) -> tuple[int, int]:
    """(requests that differ at a near tie, requests that differ otherwise) between two sides.

    A near tie is a first differing step where `reference` (generate(), which records margins)
    had the same prefix and a top-2 margin below MIN_TOP2_MARGIN: float noise of batch shapes
    may pick either token there, as DESIGN 7.1 allows.
    """
    assert reference.margins is not None
    num_near_ties = num_wrong = 0
    for idx, (a, b) in enumerate(zip(ours.tokens, theirs.tokens, strict=True)):
        step = next((t for t, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if step is None:
            continue
        same_prefix = reference.tokens[idx][:step] == a[:step]
        if same_prefix and reference.margins[idx][step] < MIN_TOP2_MARGIN:
            num_near_ties += 1
        else:
            num_wrong += 1
    return num_near_ties, num_wrong


def round_sides(round_idx: int) -> tuple[str, ...]:
    """Rotate who goes first, so that no side always runs on a warmer (or busier) machine."""
    shift = round_idx % len(SIDES)
    return SIDES[shift:] + SIDES[:shift]


def summarize(rounds: list[dict[str, float]]) -> dict[str, float | int | list[float]]:
    """Median of each figure, and each ratio as the median of its per-round values."""
    summary: dict[str, float | int | list[float]] = {"num_rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        # a count of divergences is summed over the rounds; a rate or latency is a median
        summary[key] = sum(values) if "near_tie" in key else statistics.median(values)
    ratios = {
        "ratio_output_tokens_per_s_vs_generate_batch": ("mixed", "generate_batch"),
        "ratio_output_tokens_per_s_vs_generate": ("mixed", "generate"),
        "ratio_output_tokens_per_s_vs_generate_equal_lengths": ("equal", "generate"),
        "ratio_output_tokens_per_s_vs_generate_batch_equal_lengths": ("equal", "generate_batch"),
    }
    for key, (workload, side) in ratios.items():
        ours, theirs = (
            f"{workload}_kvserve_output_tokens_per_s",
            f"{workload}_{side}_output_tokens_per_s",
        )
        if ours not in rounds[0]:
            continue  # that workload was not run
        per_round = [r[ours] / r[theirs] for r in rounds]
        summary[key] = statistics.median(per_round)
        summary[f"rounds_{key}"] = per_round
    return summary


def decode_step_ms(model_dir: Path, batch_size: int, num_steps: int) -> float:
    """Median model milliseconds of one rank's decode step of `batch_size` requests, each with
    EQUAL_PROMPT_TOKENS of context, through the real EngineCore and ModelRunner in-process."""
    from bench.workload import Workload, build_rank
    from worker.distributed import single_rank_group

    rng = random.Random(batch_size)
    prompts = [
        [rng.randrange(FIRST_PROMPT_ID, 256) for _ in range(EQUAL_PROMPT_TOKENS)]
        for _ in range(batch_size)
    ]
    blocks_per_request = (EQUAL_PROMPT_TOKENS + num_steps + 16) // 16 + 1
    workload = Workload(
        str(model_dir),
        block_size=16,
        num_blocks=1 + batch_size * blocks_per_request,
        prompts=prompts,
        sampling_params=[SamplingParams(max_tokens=num_steps + 8, ignore_eos=True)] * batch_size,
        max_num_batched_tokens=EQUAL_PROMPT_TOKENS * batch_size,  # one prefill step
        max_num_seqs=batch_size,
        enable_prefix_caching=False,
    )
    core, runner = build_rank(workload, single_rank_group(), torch.device("cpu"))
    core.step()  # the prefill
    times_ms = []
    for _ in range(num_steps):
        before_s = runner.model_s
        core.step()
        times_ms.append(1000 * (runner.model_s - before_s))
    return statistics.median(times_ms)


def decode_sweep(model_dir: Path) -> dict[str, float]:
    return {f"decode_{n}_ms_per_step": decode_step_ms(model_dir, n, 20) for n in (8, 16, 32, 64)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, help="checkpoint folder; default: make one of --arch and --shape"
    )
    parser.add_argument("--arch", choices=ARCHS, default="qwen3", help="of the checkpoint made")
    parser.add_argument(
        "--shape", choices=list(SHAPES), help="of the checkpoint made: bench, or bench-moe"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=num_rounds, default=MIN_ROUNDS, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads each side may use")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="kvserve's")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts and lengths")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")
    parser.add_argument(
        "--decode-sweep", action="store_true", help="time the decode step at 8 to 64 requests"
    )
    return parser.parse_args(argv)


def made_spec(args: argparse.Namespace) -> CheckpointSpec:
    """The checkpoint to make without --model: --arch in --shape (bench-moe for MoE archs)."""
    is_moe = args.arch in MOE_ARCHS
    shape = SHAPES[args.shape or ("bench-moe" if is_moe else "bench")]
    if is_moe != shape.has_experts:
        raise SystemExit(f"--shape {args.shape}: --arch {args.arch} expects another shape")
    return CheckpointSpec(arch=args.arch, shape=shape)


def run_round(
    runners: dict[str, Callable[[Workload], SideResult]], workloads: list[Workload], round_idx: int
) -> dict[str, float]:
    """Every workload on every side, in this round's order; the sides' tokens must agree."""
    figures: dict[str, float] = {}
    for workload in workloads:
        results = {side: runners[side](workload) for side in round_sides(round_idx)}
        for side, result in results.items():
            figures.update(result.figures(f"{workload.name}_{side}", workload.num_output_tokens))
        for side in ("generate_batch", "generate"):
            near_ties, wrong = compare_greedy(
                results["kvserve"], results[side], results["generate"]
            )
            figures[f"{workload.name}_near_tie_divergences_vs_{side}"] = near_ties
            if wrong:
                raise SystemExit(
                    f"round {round_idx}, {workload.name}: {wrong} of {len(workload.prompts)} "
                    f"requests differ from {side}'s greedy tokens, not at a near tie"
                )
    return figures


def main(argv: list[str] | None = None) -> None:
    import transformers

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    unwind_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="kvs-hf-", dir="/tmp") as tmp:
        folder = Path(tmp)
        model_dir = args.model or make_checkpoint(folder / "checkpoint", made_spec(args))
        if args.decode_sweep:
            report("one rank's decode step (CPU, in-process)", decode_sweep(model_dir), args.json)
            return
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        pad_id = model.config.pad_token_id or 0
        workloads = [
            make_workload(name, args.num_requests, model.config.vocab_size, args.seed)
            for name in args.workloads.split(",")
        ]
        launcher = start_kvserve(model_dir, folder, args.tensor_parallel_size, args.threads)
        try:
            with EngineClient(f"ipc://{folder}/client.sock") as client:
                wait_ready(client, launcher)
                runners: dict[str, Callable[[Workload], SideResult]] = {
                    "kvserve": lambda w: run_kvserve(client, w),
                    "generate_batch": lambda w: run_generate_batch(model, w, pad_id),
                    "generate": lambda w: run_generate(model, w, pad_id),
                }
                rounds = []
                for round_idx in range(args.rounds):
                    rounds.append(run_round(runners, workloads, round_idx))
                    print(f"round {round_idx + 1}/{args.rounds}: {rounds[-1]}", flush=True)
        finally:
            stop_kvserve(launcher)
    report("kvserve vs transformers on a real checkpoint (CPU)", summarize(rounds), args.json)


if __name__ == "__main__":
    main()
