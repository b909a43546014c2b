"""Structured decoding's cost: json_schema requests beside unconstrained ones on one checkpoint.

One `kvserve serve --model DIR` serves a random-weight checkpoint (bench/make_checkpoint.py). Two
client runs of greedy chats alternate over `--rounds` rounds, A B then B A. In run B (mixed) every
other chat is a json_schema request (bounded strings, arrays and numbers, so random weights end
it) and the rest are unconstrained (EOS ignored, `--output-len` tokens). Run A (plain) sends the
same chats all unconstrained, each former json_schema one with max_tokens equal to the length of
its JSON reply in a warm-up mixed run, so both runs generate the same tokens. Figures per run:
output tok/s (completion tokens over the run's wall time); for B, the JSON replies that validate.
Ratios are B / A per round, then the median: `ratio_mixed_output_tok_s` below 1 is what
structured decoding costs the server. Run: `python -m bench.structured --json FILE`.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.make_checkpoint import SHAPES, CheckpointSpec, make_checkpoint
from bench.report import report, unwind_on_sigterm
from bench.served_process import ServedProcess
from engine_core.net.endpoints import free_tcp_ports

MIN_ROUNDS = 3  # interleaved rounds a ratio needs; fewer make a smoke run, labelled as such
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 2048
JSON_MAX_TOKENS = 512  # whitespace runs are bounded (8), so the schema below always fits
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def _chat(idx: int, max_tokens: int | None) -> dict:
    """Chat `idx`: a json_schema request when `max_tokens` is None, else an unconstrained one
    of exactly `max_tokens` tokens."""
    body: dict = {
        "messages": [{"role": "user", "content": f"Tell me about person number {idx}."}],
        "temperature": 0,
    }
    if max_tokens is None:
        return body | {"max_tokens": JSON_MAX_TOKENS, "response_format": RESPONSE_FORMAT}
    return body | {"max_tokens": max_tokens, "ignore_eos": True}


def _is_valid(text: str) -> bool:
    """The reply parses and has the schema's keys and value types (no jsonschema at run time)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == set(SCHEMA["required"])
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and isinstance(value["age"], int)
        and isinstance(value["tags"], list)
        and isinstance(value["ok"], bool)
    )


async def _run(
    url: str, concurrency: int, max_tokens: list[int | None]
) -> tuple[dict[str, float], list[int]]:
    """One client run, chat i asking for `max_tokens[i]` (None: json_schema), `concurrency` at
    a time: its figures, and each chat's completion tokens."""
    limit = asyncio.Semaphore(concurrency)
    lengths = [0] * len(max_tokens)
    num_valid = 0

    async def one(client: httpx.AsyncClient, idx: int) -> None:
        nonlocal num_valid
        async with limit:
            answer = await client.post("/v1/chat/completions", json=_chat(idx, max_tokens[idx]))
        answer.raise_for_status()
        reply = answer.json()
        lengths[idx] = reply["usage"]["completion_tokens"]
        if max_tokens[idx] is None:
            num_valid += _is_valid(reply["choices"][0]["message"]["content"])

    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, idx) for idx in range(len(max_tokens))))
        duration_s = time.perf_counter() - start
    figures = {"output_tok_s": sum(lengths) / duration_s, "output_tokens": sum(lengths)}
    if None in max_tokens:
        figures["num_valid_json"] = num_valid
    return figures, lengths


def _serve(checkpoint: Path, folder: Path, extra_args: list[str]) -> ServedProcess:
    port, master_port = free_tcp_ports(2)
    command = [str(Path(sys.executable).parent / "kvserve"), "serve", "--model", str(checkpoint)]
    command += ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--master-port", str(master_port)]
    command += ["--client-address", f"ipc://{folder}/client.sock"]
    command += ["--worker-address", f"ipc://{folder}/worker.sock", *extra_args]
    return ServedProcess("kvserve", command, dict(os.environ), port, folder / "kvserve.log")


def measure(args: argparse.Namespace, checkpoint: Path, folder: Path) -> dict:
    """Alternating runs over one server; medians of each and of the per-round ratios."""
    server = _serve(checkpoint, folder, args.kvserve_args)
    mixed: list[int | None] = [
        None if idx % 2 else args.output_len for idx in range(args.num_requests)
    ]
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "mixed": []}
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        # greedy JSON replies have the same lengths in every run: the plain run matches them
        _, lengths = asyncio.run(_run(server.base_url, args.concurrency, mixed))
        plain: list[int | None] = [
            length if ask is None else ask for ask, length in zip(mixed, lengths, strict=True)
        ]
        for round_idx in range(args.rounds):
            order = ("plain", "mixed") if round_idx % 2 == 0 else ("mixed", "plain")
            for name in order:
                asks = plain if name == "plain" else mixed
                runs[name].append(asyncio.run(_run(server.base_url, args.concurrency, asks))[0])
    finally:
        server.stop()
    summary: dict = {}
    for name, rounds in runs.items():
        for key in rounds[0]:
            summary[f"{name}_{key}"] = statistics.median(figures[key] for figures in rounds)
    ratios = [
        mixed_run["output_tok_s"] / plain_run["output_tok_s"]
        for mixed_run, plain_run in zip(runs["mixed"], runs["plain"], strict=True)
    ]
    summary["ratio_mixed_output_tok_s"] = statistics.median(ratios)
    summary["rounds_ratio_mixed_output_tok_s"] = ratios
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="checkpoint folder; default: made anew")
    parser.add_argument("--shape", choices=list(SHAPES), default="bench", help="of a new one")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved A B rounds")
    parser.add_argument("--num-requests", type=int, default=32, help="chats per client run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--output-len", type=int, default=128, help="tokens of each unconstrained chat of run B"
    )
    parser.add_argument("--kvserve-args", default="", help="more `kvserve serve` flags")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    if min(args.rounds, args.num_requests, args.concurrency, args.output_len) < 1:
        parser.error("--rounds, --num-requests, --concurrency and --output-len must be >= 1")
    args.kvserve_args = args.kvserve_args.split()
    return args


def main(argv: list[str] | None = None) -> None:
    unwind_on_sigterm()
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvs-structured-", dir="/tmp") as tmp:
        folder = Path(tmp)
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = make_checkpoint(
                folder / "checkpoint", CheckpointSpec(shape=SHAPES[args.shape])
            )
        figures = {
            "num_rounds": args.rounds,
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "output_len": args.output_len,
            **measure(args, checkpoint, folder),
        }
    title = "json_schema requests beside unconstrained ones (B) against unconstrained only (A)"
    if args.rounds < MIN_ROUNDS:
        title += f" (SMOKE RUN: {args.rounds} of the {MIN_ROUNDS} rounds a ratio needs)"
    report(title, figures, args.json)


if __name__ == "__main__":
    main()
