"""The GPU check's real-checkpoint part: random-weight checkpoints served by `kvserve launch` on
CUDA, compared with transformers on the same device, and throughput figures of Qwen3-0.6B's
shape: in bfloat16, and quantized to FP8 by bench/fp8_checkpoint.py (its weights kept in fp8 on
devices of compute capability 8.9 and up). Each check returns a CheckResult; bench/gpu_check.py
runs them under its timeouts.

float32 must give transformers' greedy tokens, up to a step whose top-2 margin is below
FLOAT32_MIN_MARGIN. bfloat16 follows vLLM's check_logprobs_close: where the tokens first differ,
each side's token must be among the other's top LOGPROBS_CLOSE_TOP alternatives.
"""

import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.fp8_checkpoint import QUANTIZATION_CONFIG, write_fp8_checkpoint
from bench.make_checkpoint import SHAPES, CheckpointSpec, make_checkpoint
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.sampling import SamplingParams
from worker.models.hf.fp8_linear import keeps_fp8_weights
from worker.models.hf.quantization import read_quantization

FLOAT32_MIN_MARGIN = 1e-3
LOGPROBS_CLOSE_TOP = 5
NUM_PROMPTS = 8
PROMPT_TOKENS = (24, 96)
MAX_TOKENS = 32
STARTUP_TIMEOUT_S = 240.0
RUN_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
THROUGHPUT_REQUESTS = 64
THROUGHPUT_PROMPT_TOKENS = 128
THROUGHPUT_OUTPUT_TOKENS = 128
BF16_FIGURE_FILE = "throughput-bf16.json"  # checkpoint-throughput's figure, for the fp8 check
FP8_KEPT_LINE, FP8_DEQUANTIZED_LINE = "kept in float8", "dequantized to"  # weights.py's log
QWEN3_CHECKPOINT = CheckpointSpec(arch="qwen3", shape=SHAPES["qwen3-0.6b"], dtype="bfloat16")
# the cases the accuracy checks serve: a hybrid (two KV-cache groups), llama3 rope, a window
CASES = {
    "qwen3-mixed": CheckpointSpec(arch="qwen3", layer_types=["full", "sliding"], sliding_window=32),
    "llama-llama3": CheckpointSpec(arch="llama", rope_scaling="llama3"),
    "mistral-window": CheckpointSpec(arch="mistral", sliding_window=48),
}


@dataclass(frozen=True)
class CheckResult:
    is_passed: bool
    detail: str


def prompts(vocab_size: int, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)
    ]


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> dict:
    """transformers' greedy tokens with each step's top-2 margin and top logprobs."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack([step[0].float() for step in out.logits])  # [steps, V]
    top2 = logits.topk(2, dim=-1).values
    top_ids = torch.log_softmax(logits, dim=-1).topk(LOGPROBS_CLOSE_TOP, dim=-1).indices
    return {
        "tokens": out.sequences[0, len(prompt) :].tolist(),
        "margins": (top2[:, 0] - top2[:, 1]).tolist(),
        "top_ids": top_ids.tolist(),
    }


def launch(model_dir: Path, folder: Path, tp_size: int, dtype: str, log_path: Path):
    (master_port,) = free_tcp_ports(1)
    command = [sys.executable, "-m", "deploy", "launch", "--model", str(model_dir)]
    command += ["-tp", str(tp_size), "--device", "cuda", "--dtype", dtype]
    command += ["--master-port", str(master_port), "--gpu-memory-utilization", "0.3"]
    command += ["--client-address", f"ipc://{folder}/client.sock"]
    command += ["--worker-address", f"ipc://{folder}/worker.sock", "--log-level", "INFO"]
    log = log_path.open("wb")
    return subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True), log


def stop_launcher(launcher: subprocess.Popen) -> int:
    """SIGTERM, as Ctrl-C would; SIGKILL past the deadline. The launcher's exit code."""
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait(STOP_TIMEOUT_S)
        return -signal.SIGKILL


def serve(
    model_dir: Path, tp_size: int, dtype: str, log_path: Path, batch: list[list[int]], **params
) -> tuple[list, float]:
    """Every prompt of `batch` through a fresh deployment; (results, seconds serving them)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-gpu-") as tmp:
        folder = Path(tmp)
        launcher, log = launch(model_dir, folder, tp_size, dtype, log_path)
        try:
            with EngineClient(f"ipc://{folder}/client.sock", timeout_s=STARTUP_TIMEOUT_S) as c:
                c.check_health()
                start = time.monotonic()
                req_ids = []
                for idx, prompt in enumerate(batch):
                    c.add_request(make_request(f"r{idx}", prompt, SamplingParams(**params)))
                    req_ids.append(f"r{idx}")
                results = c.run_until_finished(req_ids, RUN_TIMEOUT_S)
                elapsed_s = time.monotonic() - start
        finally:
            code = stop_launcher(launcher)
            log.close()
    if code != 0:
        raise RuntimeError(f"kvserve launch exited {code}; its log: {log_path}")
    return [results[req_id] for req_id in req_ids], elapsed_s


def compare_float32(ours: list[int], theirs: dict) -> str | None:
    """None when the tokens agree up to the first nearly tied step; else what differs."""
    for step, (a, b) in enumerate(zip(ours, theirs["tokens"], strict=False)):
        if theirs["margins"][step] < FLOAT32_MIN_MARGIN:
            return None  # a near tie: float noise may pick either, and the rest follows it
        if a != b:
            return f"step {step}: {a} vs {b} (margin {theirs['margins'][step]:.4f})"
    return None


def compare_logprobs_close(ours: list[int], our_top: list[list[int]], theirs: dict) -> str | None:
    for step, (a, b) in enumerate(zip(ours, theirs["tokens"], strict=False)):
        if a != b:
            if a in theirs["top_ids"][step] and b in our_top[step]:
                return None  # both tokens are plausible under the other side: they diverge here
            return f"step {step}: {a} vs {b}, not in each other's top {LOGPROBS_CLOSE_TOP}"
    return None


def check_accuracy(folder: Path, tp_size: int, dtype: str) -> CheckResult:
    """Every case served on CUDA in `dtype` against transformers on CUDA in the same dtype."""
    import transformers

    details, failures = [], []
    for name, spec in CASES.items():
        model_dir = make_checkpoint(folder / f"{name}-{dtype}", spec)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        )
        hf = hf.to("cuda").eval()
        batch = prompts(hf.config.vocab_size, NUM_PROMPTS, PROMPT_TOKENS, seed=len(name))
        log_path = folder / f"{name}-{dtype}-tp{tp_size}.log"
        params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS_CLOSE_TOP)
        results, _ = serve(model_dir, tp_size, dtype, log_path, batch, **params)
        for prompt, result in zip(batch, results, strict=True):
            theirs = hf_greedy(hf, prompt, MAX_TOKENS)
            if dtype == "float32":
                problem = compare_float32(result.token_ids, theirs)
            else:
                our_top = [ids[1:] for ids in result.logprob_token_ids]
                problem = compare_logprobs_close(result.token_ids, our_top, theirs)
            if problem is not None:
                failures.append(f"{name}: {problem}")
        details.append(f"{name} {len(batch)} prompts")
        del hf
        torch.cuda.empty_cache()
    detail = f"{'; '.join(details)}; {len(failures)} differ: {failures[:3]}"
    return CheckResult(not failures, detail)


def qwen3_checkpoint(folder: Path) -> Path:
    """The random checkpoint of Qwen3-0.6B's shape in bfloat16 under `folder`, written once: the
    throughput checks share it. It is written aside and renamed, so a check stopped while
    writing leaves no half of one behind."""
    done = folder / "qwen3-0.6b"
    if not (done / "config.json").is_file():
        partial = folder / "qwen3-0.6b.partial"
        shutil.rmtree(partial, ignore_errors=True)
        make_checkpoint(partial, QWEN3_CHECKPOINT)
        partial.rename(done)
    return done


def check_throughput(folder: Path) -> CheckResult:
    """A random checkpoint of Qwen3-0.6B's shape in bfloat16: kvserve's output tokens per second
    over 64 requests beside transformers' batched generate() on the same prompts."""
    import transformers

    model_dir = qwen3_checkpoint(folder)
    shape = QWEN3_CHECKPOINT.shape
    batch = prompts(shape.vocab_size, THROUGHPUT_REQUESTS, (THROUGHPUT_PROMPT_TOKENS,) * 2, 1)
    params = dict(max_tokens=THROUGHPUT_OUTPUT_TOKENS, ignore_eos=True)
    _, kvserve_s = serve(model_dir, 1, "bfloat16", folder / "throughput.log", batch, **params)
    num_tokens = THROUGHPUT_REQUESTS * THROUGHPUT_OUTPUT_TOKENS
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf = hf.to("cuda").eval()
    torch.cuda.synchronize()
    start = time.monotonic()
    with torch.inference_mode():
        hf.generate(
            torch.tensor(batch, device="cuda"),
            max_new_tokens=THROUGHPUT_OUTPUT_TOKENS,
            min_new_tokens=THROUGHPUT_OUTPUT_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    generate_s = time.monotonic() - start
    ours, theirs = num_tokens / kvserve_s, num_tokens / generate_s
    (folder / BF16_FIGURE_FILE).write_text(json.dumps({"kvserve_tok_s": ours}))
    detail = (
        f"qwen3-0.6b shape, bf16, {THROUGHPUT_REQUESTS} x ({THROUGHPUT_PROMPT_TOKENS} prompt, "
        f"{THROUGHPUT_OUTPUT_TOKENS} output): kvserve {ours:.0f} tok/s, transformers generate() "
        f"{theirs:.0f} tok/s, ratio {ours / theirs:.2f}"
    )
    return CheckResult(True, detail)


def check_fp8_throughput(folder: Path) -> CheckResult:
    """The throughput checkpoint quantized to FP8 (a scale per output channel, activations per
    token): kvserve's output tok/s on the same 64 requests beside the bfloat16 figure, and which
    path its rank took (weights kept in fp8 where the device has FP8, dequantized elsewhere),
    read from its log with its weight memory."""
    model_dir = qwen3_checkpoint(folder)
    fp8_dir = folder / "qwen3-0.6b-fp8"
    if not (fp8_dir / "config.json").is_file():
        partial = folder / "qwen3-0.6b-fp8.partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_fp8_checkpoint(model_dir, partial).rename(fp8_dir)
    shape = QWEN3_CHECKPOINT.shape
    batch = prompts(shape.vocab_size, THROUGHPUT_REQUESTS, (THROUGHPUT_PROMPT_TOKENS,) * 2, 1)
    params = dict(max_tokens=THROUGHPUT_OUTPUT_TOKENS, ignore_eos=True)
    log_path = folder / "throughput-fp8.log"
    results, fp8_s = serve(fp8_dir, 1, "bfloat16", log_path, batch, **params)
    num_tokens = sum(len(result.token_ids) for result in results)
    text = log_path.read_text(errors="replace")
    capability = torch.cuda.get_device_capability(0)
    scheme = read_quantization({"quantization_config": QUANTIZATION_CONFIG})
    expects_kept = keeps_fp8_weights("cuda", capability, scheme)
    expected_line = FP8_KEPT_LINE if expects_kept else FP8_DEQUANTIZED_LINE
    path_lines = [line.split(": ", 1)[-1] for line in text.splitlines() if "fp8 weights on" in line]
    memory = [line.split(": ", 1)[-1] for line in text.splitlines() if "memory of" in line]
    figure = folder / BF16_FIGURE_FILE
    bf16 = (
        f"{json.loads(figure.read_text())['kvserve_tok_s']:.0f} tok/s"
        if figure.is_file()
        else "not measured (checkpoint-throughput-qwen3-0.6b did not run)"
    )
    detail = (
        f"capability {capability[0]}.{capability[1]}: fp8 {num_tokens / fp8_s:.0f} tok/s, "
        f"bf16 {bf16}; {path_lines[:1] or 'no fp8 log line'}; {memory[:1]}"
    )
    is_passed = num_tokens == THROUGHPUT_REQUESTS * THROUGHPUT_OUTPUT_TOKENS and any(
        expected_line in line for line in path_lines
    )
    return CheckResult(is_passed, detail)
