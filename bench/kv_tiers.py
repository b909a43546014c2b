"""Tiers below the pool on a multi-turn chat: prefix hit rate, TTFT p50/p99 and output tokens per
second with no tier, a host tier, host plus disk, and a device pool 4x larger (the reference a
hit rate is held to), on a real random-weight checkpoint on the CPU, in interleaved rounds.

Each conversation opens on a document of its own, then adds a user turn and an answer per turn;
the conversations take turns round-robin, a few requests in flight, so by the time one comes back
the others' contexts have pushed it out of the pool. The working set of prefixes (every
conversation's last context) is 4x the pool. A tier keeps its copy of a block it hands back up
(the engine's policy), so what the pool holds is mostly held below it too: the lowest tier gets
room for the whole working set, 4 pools (the host tier; or 1 pool of host above 4 of disk).

Run: `python -m bench.kv_tiers [--rounds 5] [--json FILE]`; `--copies` instead times the rank's
copies per block in each direction (bench/kv_tier_copies.py).
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.hf_serving import stop_kvserve, wait_ready
from bench.kv_tier_copies import copy_figures
from bench.make_checkpoint import SHAPES, CheckpointSpec, make_checkpoint
from bench.report import report, unwind_on_sigterm
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.kv_cache_spec import cdiv
from protocol.sampling import SamplingParams

SIDES = ("no_tier", "host", "host_disk", "pool_4x")
BLOCK_SIZE = 16
FIRST_PROMPT_ID = 3  # past the checkpoint maker's special tokens
RUN_TIMEOUT_S = 900.0
WORKING_SET_PER_POOL = 4  # the workload: prefixes worth 4 pools


@dataclass(frozen=True, slots=True)
class Chat:
    """The workload's shape; every side runs the same conversations."""

    num_conversations: int
    num_turns: int
    document_tokens: int  # each conversation's own opening
    user_tokens: int  # per turn
    output_tokens: int  # per turn
    num_in_flight: int  # requests outstanding at once

    @property
    def last_context_tokens(self) -> int:
        return self.document_tokens + self.num_turns * (self.user_tokens + self.output_tokens)

    @property
    def pool_blocks(self) -> int:
        """The tiered sides' pool: the working set of prefixes over WORKING_SET_PER_POOL."""
        working_set = self.num_conversations * cdiv(self.last_context_tokens, BLOCK_SIZE)
        return cdiv(working_set, WORKING_SET_PER_POOL)


@dataclass(frozen=True, slots=True)
class TurnResult:
    conv: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    tokens: list[int]


def side_flags(side: str, pool_blocks: int, block_bytes: int, folder: Path) -> list[str]:
    """Each side's pool and tiers: the lowest tier holds the working set, 4 pools."""
    num_blocks = pool_blocks * (WORKING_SET_PER_POOL if side == "pool_4x" else 1)
    flags = ["--num-gpu-blocks-override", str(num_blocks + 1)]  # + the null block
    flags += ["--kv-cache-memory-bytes", str((num_blocks + 1) * block_bytes)]
    if side == "host":
        flags += ["--kv-offload-host-bytes", str(WORKING_SET_PER_POOL * pool_blocks * block_bytes)]
    if side == "host_disk":
        flags += ["--kv-offload-host-bytes", str(pool_blocks * block_bytes)]
        flags += ["--kv-offload-disk-bytes", str(WORKING_SET_PER_POOL * pool_blocks * block_bytes)]
        flags += ["--kv-offload-disk-dir", str(folder / "disk")]
    return flags


def start_side(
    side: str, model_dir: Path, folder: Path, flags: list[str], max_model_len: int, threads: int
) -> subprocess.Popen:
    (master_port,) = free_tcp_ports(1)
    command = [str(Path(sys.executable).parent / "kvserve"), "launch", "--model", str(model_dir)]
    command += ["--master-port", str(master_port), "--device", "cpu", *flags]
    command += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_model_len)]
    command += ["--client-address", f"ipc://{folder}/{side}-client.sock"]
    command += ["--worker-address", f"ipc://{folder}/{side}-worker.sock", "--log-level", "WARNING"]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(command, env=env, start_new_session=True)


def make_chats(chat: Chat, vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each conversation's document, and its user turns flattened in order."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(count)]

    documents = [ids(chat.document_tokens) for _ in range(chat.num_conversations)]
    users = [ids(chat.num_turns * chat.user_tokens) for _ in range(chat.num_conversations)]
    return documents, users


def run_chat(
    client: EngineClient, chat: Chat, documents: list[list[int]], users: list[list[int]]
) -> tuple[list[TurnResult], float]:
    """Every turn of every conversation, round-robin with `num_in_flight` outstanding: the
    conversations' results, turn by turn, and the wall seconds."""
    client.reset_prefix_cache()
    contexts = [list(document) for document in documents]
    order = [
        (turn, conv) for turn in range(chat.num_turns) for conv in range(chat.num_conversations)
    ]
    params = SamplingParams(max_tokens=chat.output_tokens, temperature=0.0, ignore_eos=True)
    pending: dict[str, tuple[int, int]] = {}
    results: list[TurnResult] = []
    start = time.monotonic()
    deadline = start + RUN_TIMEOUT_S
    next_idx = 0
    while next_idx < len(order) or pending:
        # a conversation's next turn waits for its last answer
        busy = {conv for _, conv in pending.values()}
        while (
            next_idx < len(order)
            and len(pending) < chat.num_in_flight
            and order[next_idx][1] not in busy
        ):
            turn, conv = order[next_idx]
            user = users[conv][turn * chat.user_tokens : (turn + 1) * chat.user_tokens]
            contexts[conv] += user
            req_id = f"chat-{conv}-{turn}-{time.monotonic_ns()}"
            client.add_request(make_request(req_id, list(contexts[conv]), params))
            pending[req_id] = (turn, conv)
            busy.add(conv)
            next_idx += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} turns unfinished after {RUN_TIMEOUT_S} s")
        client.poll_outputs(1.0)
        for req_id in [r for r in pending if client.result(r).is_finished]:
            turn, conv = pending.pop(req_id)
            result = client.result(req_id)
            if result.finish_reason != "length":
                raise RuntimeError(f"{req_id} ended {result.finish_reason}: {result.error}")
            prompt_tokens = len(contexts[conv])
            contexts[conv] += result.token_ids
            ttft_s = (result.first_token_time or result.submit_time) - result.submit_time
            results.append(
                TurnResult(
                    conv, turn, prompt_tokens, result.num_cached_tokens, ttft_s, result.token_ids
                )
            )
    return results, time.monotonic() - start


def side_figures(side: str, results: list[TurnResult], wall_s: float) -> dict[str, float]:
    ttft_ms = sorted(1000 * r.ttft_s for r in results)
    num_output = sum(len(r.tokens) for r in results)
    return {
        f"{side}_prefix_hit_rate": sum(r.cached_tokens for r in results)
        / sum(r.prompt_tokens for r in results),
        f"{side}_ttft_p50_ms": statistics.median(ttft_ms),
        f"{side}_ttft_p99_ms": ttft_ms[min(len(ttft_ms) - 1, int(0.99 * len(ttft_ms)))],
        f"{side}_output_tokens_per_s": num_output / wall_s,
    }


def summarize(rounds: list[dict[str, float]]) -> dict[str, float | int | list[float]]:
    """Medians of each figure, and the goals' ratios as medians of their per-round values."""
    summary: dict[str, float | int | list[float]] = {"num_rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds]  # a count of differing turns is summed over rounds
        summary[key] = sum(values) if "differing" in key else statistics.median(values)
    for side in ("host", "host_disk"):
        # the goals: a hit rate within 5 points of the 4x pool, a TTFT p50 at least 2x better
        gap = [r["pool_4x_prefix_hit_rate"] - r[f"{side}_prefix_hit_rate"] for r in rounds]
        speedup = [r["no_tier_ttft_p50_ms"] / r[f"{side}_ttft_p50_ms"] for r in rounds]
        throughput = [
            r[f"{side}_output_tokens_per_s"] / r["no_tier_output_tokens_per_s"] for r in rounds
        ]
        summary[f"{side}_hit_rate_points_below_pool_4x"] = 100 * statistics.median(gap)
        summary[f"ratio_ttft_p50_no_tier_over_{side}"] = statistics.median(speedup)
        summary[f"rounds_ratio_ttft_p50_no_tier_over_{side}"] = speedup
        summary[f"ratio_output_tokens_per_s_{side}_over_no_tier"] = statistics.median(throughput)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint; default: a bench-shape qwen3")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 3)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3, help="per conversation")
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=2, help="requests outstanding at once")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each engine's rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")
    parser.add_argument("--copies", action="store_true", help="time the rank's copies instead")
    parser.add_argument("--repeats", type=int, default=30, help="--copies: steps per direction")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds {args.rounds}: expected at least 3")
    return args


def main(argv: list[str] | None = None) -> None:
    unwind_on_sigterm()
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.copies:
        figures = copy_figures(args.repeats, args.seed)
        report("a rank's tier copies, µs per block (CPU)", figures, args.json)
        return
    chat = Chat(
        args.conversations,
        args.turns,
        args.document_tokens,
        args.user_tokens,
        args.output_tokens,
        args.in_flight,
    )
    shape = SHAPES["bench"]
    block_bytes = shape.num_layers * 2 * BLOCK_SIZE * shape.num_kv_heads * shape.head_dim * 4
    with tempfile.TemporaryDirectory(prefix="kvs-tiers-", dir="/tmp") as tmp:
        folder = Path(tmp)
        (folder / "disk").mkdir()
        model_dir = args.model or make_checkpoint(
            folder / "checkpoint", CheckpointSpec(shape=shape)
        )
        launchers = {
            side: start_side(
                side,
                model_dir,
                folder,
                side_flags(side, chat.pool_blocks, block_bytes, folder),
                chat.last_context_tokens + chat.output_tokens,
                args.threads,
            )
            for side in SIDES
        }
        clients = {side: EngineClient(f"ipc://{folder}/{side}-client.sock") for side in SIDES}
        try:
            for side in SIDES:
                wait_ready(clients[side], launchers[side])
            rounds = [
                run_round(clients, chat, shape.vocab_size, args.seed, i) for i in range(args.rounds)
            ]
        finally:
            for side in SIDES:
                clients[side].close()
                stop_kvserve(launchers[side])
    summary = summarize(rounds)
    summary["pool_blocks"] = chat.pool_blocks
    summary["block_bytes"] = block_bytes
    report("tiers below the pool: multi-turn chat on a real checkpoint (CPU)", summary, args.json)


def run_round(
    clients: dict[str, EngineClient], chat: Chat, vocab_size: int, seed: int, round_idx: int
) -> dict[str, float]:
    """Every side on this round's conversations, in a rotated order; tokens must agree."""
    documents, users = make_chats(chat, vocab_size, seed + round_idx)
    shift = round_idx % len(SIDES)
    figures: dict[str, float] = {}
    tokens: dict[str, dict[tuple[int, int], list[int]]] = {}
    for side in SIDES[shift:] + SIDES[:shift]:
        results, wall_s = run_chat(clients[side], chat, documents, users)
        figures.update(side_figures(side, results, wall_s))
        tokens[side] = {(r.conv, r.turn): r.tokens for r in results}
    for side in SIDES[1:]:  # float noise of a cached prefix against a recomputed one (DESIGN 7.1)
        figures[f"{side}_turns_differing_from_no_tier"] = sum(
            tokens[side][key] != value for key, value in tokens["no_tier"].items()
        )
    print(f"round {round_idx + 1}: {figures}", flush=True)
    return figures


if __name__ == "__main__":
    main()
