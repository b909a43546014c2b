"""kvserve against vLLM's CPU build, both served over HTTP and driven by `vllm bench serve`.

Per dtype, `kvserve serve` and `vllm serve` serve one random SmolLM2-135M-shaped llama; the same
client (`vllm bench serve`, random prompts, greedy, EOS ignored) runs against each in turn, A B
then B A, over `--rounds` rounds with one seed per round (both sides get the same prompts, and
no round hits the prefix cache of an earlier one). Figures: output tok/s, TPOT p50 and mean,
TTFT p50; ratios are kvserve / vLLM per round, then the median (above 1 is better for tok/s,
below 1 for the latencies). Run: `python -m bench.cpu_serving --peer-python DIR/bin/python`.

Both servers stay up for a whole dtype and the client alternates between them, which saves a
50-190 s vLLM start per round. That is sound because an idle server barely runs: measured on
2 cores over 10 s (utime+stime of its whole session in /proc), kvserve took 0.3-0.6% of a core
and vLLM 1.0-1.4% once settled (6-7% in the 10 s right after a run, while that run winds down).
Each run measures it again: `*_other_server_cpu_share` is the idle server's CPU over the
client's whole run (its ~10 s of imports included) divided by the run's duration, an upper bound
(0.6-1.7% in the first runs); a warning says when it passes 2%.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.make_checkpoint import SHAPES, CheckpointSpec, make_checkpoint
from bench.peer_rounds import (
    Figures,
    PeerRatio,
    PeerRound,
    Side,
    Summary,
    median_figures,
    round_order,
    round_ratio,
)
from bench.report import report, unwind_on_sigterm
from bench.served_process import ServedProcess
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports

# A ratio needs 3 interleaved rounds (not peer_rounds' 5: each round is two client runs of
# minutes on 2 shared cores); fewer make a smoke run, labelled as such in the output.
MIN_ROUNDS = 3
DTYPES = ("float32", "bfloat16")
SERVED_MODEL_NAME = "smollm2-135m-random"
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 2  # each server's KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE)
STARTUP_TIMEOUT_S = 600.0  # vLLM compiles at startup: 50-100 s alone, more beside other work
CLIENT_TIMEOUT_S = 3600.0
STATS_TIMEOUT_S = 10.0
IDLE_WINDOW_S = 10.0
MAX_IDLE_CPU_SHARE = 0.02  # of one core; past it an idle server perturbs the other's figures
WARMUP_NUM_PROMPTS = 4
WARMUP_OUTPUT_LEN = 16
WARMUP_SEED_OFFSET = 10_000  # warm-up prompts never share a prefix with a measured round's
RATIO_FIGURES = ("output_tok_s", "tpot_p50_ms", "tpot_mean_ms", "ttft_p50_ms")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VLLM_SERVE_ENV = OFFLINE_ENV | {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    # on 2 cores: one OpenMP compute thread, the other core left to its front end and engine
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
}
CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
DEFAULT_PEER_PYTHON = CACHE_HOME / "kvserve-peers" / "vllm-cpu" / "bin" / "python"
DEFAULT_CHECKPOINT = CACHE_HOME / "kvserve-bench" / "smollm2-135m-llama"


@dataclass(frozen=True, slots=True)
class Workload:
    """What `vllm bench serve` sends each side: random prompts, a fixed output length."""

    input_len: int  # prompt tokens per request
    output_len: int  # output tokens per request (EOS ignored)
    num_prompts: int
    max_concurrency: int


@dataclass(frozen=True, slots=True)
class Servers:
    """One dtype's two servers and the engine address of kvserve's (for its step counters)."""

    kvserve: ServedProcess
    vllm: ServedProcess
    kvserve_engine_address: str

    @property
    def both(self) -> tuple[ServedProcess, ServedProcess]:
        return (self.kvserve, self.vllm)

    def of(self, side: Side) -> ServedProcess:
        return self.kvserve if side is Side.OURS else self.vllm


def checkpoint_folder(requested: Path | None) -> Path:
    """`requested`, or the cached SmolLM2-135M-shaped llama, built there the first time."""
    if requested is not None:
        if not (requested / "config.json").exists():
            raise SystemExit(f"--checkpoint {requested}: no config.json there")
        return requested
    if (DEFAULT_CHECKPOINT / "config.json").exists():
        return DEFAULT_CHECKPOINT
    partial = DEFAULT_CHECKPOINT.with_name(DEFAULT_CHECKPOINT.name + ".partial")
    spec = CheckpointSpec(arch="llama", shape=SHAPES["smollm2-135m"], tie_word_embeddings=True)
    print(f"building the checkpoint in {DEFAULT_CHECKPOINT} (once)", flush=True)
    make_checkpoint(partial, spec)
    partial.rename(DEFAULT_CHECKPOINT)  # whole or absent: an interrupted build is never reused
    return DEFAULT_CHECKPOINT


def start_kvserve(
    checkpoint: Path, dtype: str, folder: Path, extra_args: list[str]
) -> tuple[ServedProcess, str]:
    """`kvserve serve` on the CPU with its own sockets and ports; the server and engine address."""
    port, master_port = free_tcp_ports(2)
    engine_address = f"ipc://{folder}/kvserve-{dtype}-client.sock"
    command = [str(Path(sys.executable).parent / "kvserve"), "serve", "--model", str(checkpoint)]
    command += ["--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", SERVED_MODEL_NAME]
    command += ["--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30)]
    command += ["--client-address", engine_address, "--master-port", str(master_port)]
    command += ["--worker-address", f"ipc://{folder}/kvserve-{dtype}-worker.sock"]
    command += extra_args  # last, so that they override any of the above
    log_path = folder / f"kvserve-{dtype}.log"
    return ServedProcess("kvserve", command, dict(os.environ), port, log_path), engine_address


def start_vllm(
    vllm_bin: Path, checkpoint: Path, dtype: str, folder: Path, extra_args: list[str]
) -> ServedProcess:
    (port,) = free_tcp_ports(1)
    command = [str(vllm_bin), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--served-model-name", SERVED_MODEL_NAME, *extra_args]
    env = os.environ | VLLM_SERVE_ENV
    return ServedProcess("vllm", command, env, port, folder / f"vllm-{dtype}.log")


def run_client(
    vllm_bin: Path, server: ServedProcess, checkpoint: Path, workload: Workload, seed: int, tag: str
) -> dict:
    """One `vllm bench serve` run against `server`: the results it saved."""
    folder = server.log_path.parent
    command = [str(vllm_bin), "bench", "serve", "--backend", "openai", "--base-url"]
    command += [server.base_url, "--model", SERVED_MODEL_NAME, "--tokenizer", str(checkpoint)]
    command += ["--dataset-name", "random", "--random-input-len", str(workload.input_len)]
    command += ["--random-output-len", str(workload.output_len), "--ignore-eos"]
    command += ["--num-prompts", str(workload.num_prompts), "--temperature", "0"]
    command += ["--max-concurrency", str(workload.max_concurrency), "--seed", str(seed)]
    command += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    command += ["--save-result", "--result-dir", str(folder), "--result-filename", f"{tag}.json"]
    command += ["--disable-tqdm"]
    with open(folder / f"{tag}.log", "wb") as log:
        finished = subprocess.run(
            command,
            env=os.environ | OFFLINE_ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=CLIENT_TIMEOUT_S,
            check=False,
        )
    if finished.returncode != 0:
        tail = (folder / f"{tag}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(
            f"vllm bench serve against {server.name} exited {finished.returncode}:\n{tail}"
        )
    return json.loads((folder / f"{tag}.json").read_text())


def client_figures(result: dict, workload: Workload) -> Figures:
    """The figures of one client run; raises if any request failed."""
    if result["failed"] or result["completed"] != workload.num_prompts:
        raise RuntimeError(
            f"{result['failed']} requests failed, {result['completed']} of "
            f"{workload.num_prompts} completed"
        )
    return {
        "output_tok_s": result["output_throughput"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "tpot_mean_ms": result["mean_tpot_ms"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_mean_ms": result["mean_ttft_ms"],
        "num_input_tokens": result["total_input_tokens"],
        "num_output_tokens": result["total_output_tokens"],
    }


def engine_counters(engine_address: str) -> dict[str, float]:
    """kvserve's step counters, from its engine's get_stats (cheap: one utility call)."""
    with EngineClient(engine_address, timeout_s=STATS_TIMEOUT_S) as client:
        stats = client.get_stats()
    return {key: float(stats[key]) for key in ("num_engine_steps", "rank_forward_s")}  # type: ignore[index]


def step_figures(before: dict[str, float], after: dict[str, float], duration_s: float) -> Figures:
    """Per-step timings of kvserve over one run: the model's forward per step, and its share."""
    num_steps = after["num_engine_steps"] - before["num_engine_steps"]
    forward_s = after["rank_forward_s"] - before["rank_forward_s"]
    return {
        "num_steps": int(num_steps),
        "forward_ms_per_step": 1000 * forward_s / max(1.0, num_steps),
        "forward_share": forward_s / duration_s,
    }


def measure(
    servers: Servers, side: Side, args: argparse.Namespace, checkpoint: Path, tag: str, seed: int
) -> Figures:
    """One measured client run against `side`, with the other server's CPU over it."""
    other = servers.of(Side.PEER if side is Side.OURS else Side.OURS)
    counters_before = engine_counters(servers.kvserve_engine_address) if side is Side.OURS else {}
    other_before_s = other.cpu_s()
    result = run_client(args.vllm_bin, servers.of(side), checkpoint, args.workload, seed, tag)
    figures = client_figures(result, args.workload)
    # all of the idle server's CPU over the client's run, imports included, as if it had fallen
    # in the measured window: an upper bound of what it took from the side measured
    figures["other_server_cpu_share"] = (other.cpu_s() - other_before_s) / result["duration"]
    if figures["other_server_cpu_share"] > MAX_IDLE_CPU_SHARE:
        print(
            f"warning: {other.name} used {figures['other_server_cpu_share']:.1%} of a core "
            f"while {servers.of(side).name} was measured",
            flush=True,
        )
    if side is Side.OURS:
        after = engine_counters(servers.kvserve_engine_address)
        figures.update(step_figures(counters_before, after, result["duration"]))
    return figures


def check_same_work(ours: Figures, peer: Figures) -> None:
    for key in ("num_input_tokens", "num_output_tokens"):
        if ours[key] != peer[key]:
            raise RuntimeError(f"{key}: kvserve {ours[key]}, vLLM {peer[key]}: expected equal")


def dtype_summary(dtype: str, rounds: list[PeerRound]) -> Summary:
    """Each side's medians (`kvserve_*`, `vllm_*`) and each ratio's median and per-round values,
    every key ending in the dtype."""
    summary: Summary = {}
    for name, side_rounds in (
        ("kvserve", [r.ours for r in rounds]),
        ("vllm", [r.peer for r in rounds]),
    ):
        medians = median_figures(side_rounds)
        summary.update({f"{name}_{key}_{dtype}": value for key, value in medians.items()})  # type: ignore[misc]
    for figure in RATIO_FIGURES:
        ratio = PeerRatio(f"ratio_{figure}_{dtype}", figure, is_ours_over_peer=True)
        per_round = [round_ratio(r.ours, r.peer, ratio) for r in rounds]
        summary[ratio.key] = statistics.median(per_round)
        summary[f"rounds_{ratio.key}"] = per_round
    return summary


def start_servers(args: argparse.Namespace, dtype: str, checkpoint: Path, folder: Path) -> Servers:
    """Both servers at once: kvserve is up in seconds, while vLLM compiles for a minute or two."""
    kvserve, engine_address = start_kvserve(checkpoint, dtype, folder, args.kvserve_args)
    vllm = start_vllm(args.vllm_bin, checkpoint, dtype, folder, args.vllm_args)
    return Servers(kvserve, vllm, engine_address)


def prepare(servers: Servers, args: argparse.Namespace, dtype: str, checkpoint: Path) -> Summary:
    """Wait for both, warm each with a few requests, then measure both while idle."""
    summary: Summary = {}
    for server in servers.both:
        summary[f"{server.name}_startup_s_{dtype}"] = server.wait_ready(STARTUP_TIMEOUT_S)
    input_len = args.workload.input_len
    warmup = Workload(input_len, WARMUP_OUTPUT_LEN, WARMUP_NUM_PROMPTS, WARMUP_NUM_PROMPTS)
    seed = args.seed + WARMUP_SEED_OFFSET
    # vLLM first: it keeps a few % of a core busy for ~10 s after a run, which then falls in
    # kvserve's warm-up rather than in the idle window below
    for server in reversed(servers.both):
        run_client(args.vllm_bin, server, checkpoint, warmup, seed, f"warmup-{server.name}-{dtype}")
    before_s = [server.cpu_s() for server in servers.both]
    time.sleep(IDLE_WINDOW_S)
    for server, cpu_before_s in zip(servers.both, before_s, strict=True):
        idle_share = (server.cpu_s() - cpu_before_s) / IDLE_WINDOW_S
        summary[f"{server.name}_idle_cpu_share_{dtype}"] = idle_share
    return summary


def measure_round(
    servers: Servers, args: argparse.Namespace, dtype: str, checkpoint: Path, round_idx: int
) -> PeerRound:
    """Both sides on this round's prompts, in this round's order."""
    order = round_order(round_idx)
    seed = args.seed + round_idx
    figures = {
        side: measure(
            servers, side, args, checkpoint, f"{servers.of(side).name}-{dtype}-{round_idx}", seed
        )
        for side in order
    }
    check_same_work(figures[Side.OURS], figures[Side.PEER])
    shown = "; ".join(f"{servers.of(side).name} {_brief(figures[side])}" for side in order)
    print(f"{dtype} round {round_idx + 1}/{args.rounds}: {shown}", flush=True)
    return PeerRound(figures[Side.OURS], figures[Side.PEER], order)


def run_dtype(args: argparse.Namespace, dtype: str, checkpoint: Path, folder: Path) -> Summary:
    servers = start_servers(args, dtype, checkpoint, folder)
    try:
        summary = prepare(servers, args, dtype, checkpoint)
        rounds = [
            measure_round(servers, args, dtype, checkpoint, round_idx)
            for round_idx in range(args.rounds)
        ]
    finally:
        for server in servers.both:
            server.stop()
    return summary | dtype_summary(dtype, rounds)


def _brief(figures: Figures) -> str:
    return (
        f"{figures['output_tok_s']:.1f} tok/s, TPOT p50 {figures['tpot_p50_ms']:.0f} ms, "
        f"TTFT p50 {figures['ttft_p50_ms']:.0f} ms"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peer-python",
        type=Path,
        default=DEFAULT_PEER_PYTHON,
        help="python of the vLLM CPU venv (setup-vllm-cpu.sh DIR builds it); its `vllm` serves "
        "the peer and runs the client for both sides",
    )
    parser.add_argument(
        "--checkpoint", type=Path, help=f"checkpoint folder to serve; default {DEFAULT_CHECKPOINT}"
    )
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, each served")
    parser.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"interleaved rounds per dtype; fewer than {MIN_ROUNDS} only check the bench runs",
    )
    parser.add_argument("--seed", type=int, default=0, help="round N's prompts use seed + N")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per client run")
    parser.add_argument("--max-concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--kvserve-args", default="", help="more `kvserve serve` flags, shell-quoted, applied last"
    )
    parser.add_argument(
        "--vllm-args", default="", help="more `vllm serve` flags, shell-quoted, applied last"
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    args.dtypes = [dtype.strip() for dtype in args.dtypes.split(",") if dtype.strip()]
    bad = [dtype for dtype in args.dtypes if dtype not in DTYPES]
    if bad or not args.dtypes:
        parser.error(f"--dtypes {bad or args.dtypes}: expected some of {list(DTYPES)}")
    sizes = (args.input_len, args.output_len, args.num_prompts, args.max_concurrency)
    if min(sizes) < 1 or args.input_len + args.output_len > MAX_MODEL_LEN:
        parser.error(
            f"workload {sizes}: every size must be >= 1 and input + output <= {MAX_MODEL_LEN}"
        )
    args.workload = Workload(*sizes)
    args.kvserve_args = shlex.split(args.kvserve_args)
    args.vllm_args = shlex.split(args.vllm_args)
    args.vllm_bin = args.peer_python.parent / "vllm"  # serves the peer, and is both sides' client
    return args


def main(argv: list[str] | None = None) -> None:
    unwind_on_sigterm()
    args = parse_args(argv)
    if not args.vllm_bin.exists():
        raise SystemExit(
            f"{args.vllm_bin} not found: pass --peer-python DIR/bin/python of a vLLM CPU venv"
        )
    checkpoint = checkpoint_folder(args.checkpoint)
    workload = args.workload
    figures: Summary = {
        "num_rounds": args.rounds,
        "input_len": workload.input_len,
        "output_len": workload.output_len,
        "num_prompts": workload.num_prompts,
        "max_concurrency": workload.max_concurrency,
        "kvserve_args": shlex.join(args.kvserve_args),
        "vllm_args": shlex.join(args.vllm_args),
    }
    with tempfile.TemporaryDirectory(prefix="kvs-cpu-serving-", dir="/tmp") as tmp:
        for dtype in args.dtypes:
            figures |= run_dtype(args, dtype, checkpoint, Path(tmp))
    title = "kvserve vs vLLM's CPU build, served, `vllm bench serve` as the client"
    if args.rounds < MIN_ROUNDS:
        title += f" (SMOKE RUN: {args.rounds} of the {MIN_ROUNDS} rounds a ratio needs)"
    report(title, figures, args.json)


if __name__ == "__main__":
    main()
