"""`kvserve bench`: drive a running engine with random prompts, show a progress bar, and print a
results table (requests, output tokens per second, TTFT p50/p99, prefix-cache hit rate).
"""

import argparse
import random
import statistics
import sys
import time
import uuid

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from deploy.keys import add_keys_flag, keys_from
from engine_client.errors import EngineDeadError
from engine_client.request import RequestResult, make_request
from engine_client.sync_client import EngineClient
from protocol.config import EngineConfig
from protocol.sampling import SamplingParams

DEFAULT_CLIENT_ADDRESS = EngineConfig().client_address
POLL_S = 0.25  # progress bar refresh


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="drive a running engine and print a results table")
    bench.add_argument("--address", default=DEFAULT_CLIENT_ADDRESS, help="engine client socket")
    bench.add_argument("--num-requests", type=int, default=64, help="requests; default 64")
    bench.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt; default 128")
    bench.add_argument(
        "--shared-prefix-len", type=int, default=64, help="tokens every prompt shares; default 64"
    )
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens per output; default 32")
    bench.add_argument("--vocab-size", type=int, default=500, help="token ids drawn below it")
    bench.add_argument("--timeout-s", type=float, default=300.0, help="seconds for the whole run")
    add_keys_flag(bench, "client")
    bench.set_defaults(handler=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    check_bench_args(args)
    console = Console()
    with EngineClient(args.address, args.timeout_s, keys_from(args, "client")) as client:
        start = time.monotonic()
        try:
            req_ids = submit_prompts(client, args)
            wait_with_progress(client, req_ids, console, start + args.timeout_s)
            elapsed_s = time.monotonic() - start
            stats = client.get_stats()
        except (TimeoutError, EngineDeadError) as exc:
            print(f"kvserve bench: {exc}", file=sys.stderr)
            return 1
        results = [client.result(req_id) for req_id in req_ids]
    console.print(results_table(results, stats, elapsed_s))
    return 0 if all(result.error is None for result in results) else 1


def check_bench_args(args: argparse.Namespace) -> None:
    from deploy.flags import UsageError

    for name in ("num_requests", "prompt_len", "max_tokens", "vocab_size"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {getattr(args, name)}: expected at least 1")


def submit_prompts(client: EngineClient, args: argparse.Namespace) -> list[str]:
    """Random prompts that share their first `shared_prefix_len` tokens; their req_ids."""
    rng = random.Random(0)
    prefix_len = min(args.shared_prefix_len, args.prompt_len)
    prefix = [rng.randrange(3, args.vocab_size) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    req_ids = []
    run_id = uuid.uuid4().hex[:12]  # ids are unique per run, so runs never collide in logs
    for i in range(args.num_requests):
        tail = [rng.randrange(3, args.vocab_size) for _ in range(args.prompt_len - prefix_len)]
        req_ids.append(f"bench-{run_id}-{i}")
        client.add_request(make_request(req_ids[-1], prefix + tail, params))
    return req_ids


def wait_with_progress(
    client: EngineClient, req_ids: list[str], console: Console, deadline: float
) -> None:
    with Progress(console=console) as progress:
        task = progress.add_task("requests", total=len(req_ids))
        num_done = 0
        while num_done < len(req_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(req_ids) - num_done} requests unfinished at the deadline")
            client.poll_outputs(POLL_S)
            now_done = sum(client.result(req_id).is_finished for req_id in req_ids)
            progress.advance(task, now_done - num_done)
            num_done = now_done


def results_table(results: list[RequestResult], stats: dict, elapsed_s: float) -> Table:
    ttfts_ms = sorted(
        1000 * (r.first_token_time - r.submit_time)
        for r in results
        if r.first_token_time is not None
    )
    queries = stats.get("prefix_cache_queries", 0) or 0
    num_tokens = sum(len(result.token_ids) for result in results)
    rows = [
        ("requests", str(len(results))),
        ("errors", str(sum(result.error is not None for result in results))),
        ("output tokens / s", f"{num_tokens / elapsed_s:.1f}"),
        ("TTFT p50 (ms)", f"{statistics.median(ttfts_ms):.1f}" if ttfts_ms else "-"),
        ("TTFT p99 (ms)", f"{percentile(ttfts_ms, 0.99):.1f}" if ttfts_ms else "-"),
        (
            "prefix-cache hit rate",
            f"{100 * stats.get('prefix_cache_hits', 0) / queries:.1f}%" if queries else "-",
        ),
        ("preemptions", str(stats.get("num_preemptions", 0))),
    ]
    table = Table(title="kvserve bench")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]
