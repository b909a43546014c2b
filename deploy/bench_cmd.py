"""`kvserve bench`: drive a running engine with random prompts, show a progress bar, and print a
results table (requests, output tokens per second, TTFT p50/p99, prefix-cache hit rate).
"""

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from engine_core.client import EngineClient, make_request
from protocol.sampling import SamplingParams

DEFAULT_CLIENT_ADDRESS = "ipc:///tmp/kvserve-client.sock"


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
    bench.set_defaults(handler=bench_command)


def bench_command(args: argparse.Namespace) -> int:
    from deploy.flags import UsageError

    for name in ("num_requests", "prompt_len", "max_tokens", "vocab_size"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {getattr(args, name)}: expected at least 1")
    rng = random.Random(0)
    prefix = [
        rng.randrange(3, args.vocab_size)
        for _ in range(min(args.shared_prefix_len, args.prompt_len))
    ]
    console = Console()
    with EngineClient(args.address, timeout_s=args.timeout_s) as client:
        start = time.monotonic()
        req_ids = []
        for i in range(args.num_requests):
            tail = [rng.randrange(3, args.vocab_size) for _ in range(args.prompt_len - len(prefix))]
            req_id = f"bench-{i}"
            client.add_request(
                make_request(
                    req_id,
                    prefix + tail,
                    SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                )
            )
            req_ids.append(req_id)
        with Progress(console=console) as progress:
            task = progress.add_task("requests", total=len(req_ids))
            num_done = 0
            while num_done < len(req_ids):
                client.poll_outputs(0.25)
                now_done = sum(client.result(r).is_finished for r in req_ids)
                progress.advance(task, now_done - num_done)
                num_done = now_done
                if time.monotonic() - start > args.timeout_s:
                    raise TimeoutError(f"bench unfinished after {args.timeout_s} s")
        elapsed_s = time.monotonic() - start
        stats = client.get_stats()
    results = [client.result(r) for r in req_ids]
    ttfts = sorted(
        1000 * (r.first_token_time - r.submit_time) for r in results if r.first_token_time
    )
    queries = stats.get("prefix_cache_queries", 0) or 0
    table = Table(title="kvserve bench")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("requests", str(len(results)))
    table.add_row("errors", str(sum(r.error is not None for r in results)))
    table.add_row("output tokens / s", f"{sum(len(r.token_ids) for r in results) / elapsed_s:.1f}")
    table.add_row("TTFT p50 (ms)", f"{statistics.median(ttfts):.1f}" if ttfts else "-")
    table.add_row(
        "TTFT p99 (ms)",
        f"{ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]:.1f}" if ttfts else "-",
    )
    table.add_row(
        "prefix-cache hit rate",
        f"{100 * stats.get('prefix_cache_hits', 0) / queries:.1f}%" if queries else "-",
    )
    table.add_row("preemptions", str(stats.get("num_preemptions", 0)))
    console.print(table)
    return 0 if all(r.error is None for r in results) else 1
