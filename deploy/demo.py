"""`kvserve demo`: a TP=2 tiny-llama engine on the CPU serving a built-in multi-turn chat workload
with shared system prompts, a progress bar, a results table, and a check of every output against
the non-paged reference model. Exit 0 only when every output matches.
"""

import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from deploy.bench_cmd import percentile
from deploy.launch import Deployment, worker_configs
from engine_client.request import RequestResult, make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig
from protocol.sampling import SamplingParams
from worker.models.fake.reference import ReferenceModel

PROGRESS_POLL_S = 0.25  # longest wait for outputs between progress bar updates


@dataclass(frozen=True)
class DemoSettings:
    tp_size: int = 2
    model: str = "tiny-llama"
    num_conversations: int = 8
    num_turns: int = 4
    num_system_prompts: int = 2
    system_prompt_len: int = 64  # tokens shared by the conversations of one system prompt
    user_turn_len: int = 12  # tokens a user adds each turn
    max_tokens: int = 16  # tokens generated per turn
    kv_cache_memory_bytes: int = 1 << 20  # per rank: 64 blocks of tiny-llama, tight on purpose
    seed: int = 0


def demo_configs(settings: DemoSettings, folder: str) -> tuple[EngineConfig, list[WorkerConfig]]:
    engine = EngineConfig(
        tp_size=settings.tp_size,
        client_address=f"ipc://{folder}/client.sock",
        worker_address=f"ipc://{folder}/worker.sock",
        cache=CacheConfig(kv_cache_memory_bytes=settings.kv_cache_memory_bytes),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=512),
        handshake_timeout_s=60.0,
    ).checked()
    base = WorkerConfig(model=settings.model, device="cpu", master_port=free_tcp_ports(1)[0])
    return engine, worker_configs(engine, base)


class Workload:
    """Conversations that grow turn by turn: system prompt, then user and assistant tokens.

    Invariants: every history starts with one of the system prompts and only grows.
    """

    def __init__(self, settings: DemoSettings) -> None:
        self.settings = settings
        rng = random.Random(settings.seed)
        system_prompts = [
            [rng.randrange(3, 500) for _ in range(settings.system_prompt_len)]
            for _ in range(settings.num_system_prompts)
        ]
        self.histories = [
            list(system_prompts[c % settings.num_system_prompts])
            for c in range(settings.num_conversations)
        ]
        self._rng = rng

    def next_prompts(self) -> list[list[int]]:
        """Every conversation's history plus a new user turn."""
        for history in self.histories:
            history.extend(self._rng.randrange(3, 500) for _ in range(self.settings.user_turn_len))
        return [list(history) for history in self.histories]

    def add_replies(self, replies: list[list[int]]) -> None:
        for history, reply in zip(self.histories, replies, strict=True):
            history.extend(reply)


def run_workload(
    client: EngineClient, settings: DemoSettings, progress: Progress
) -> list[tuple[list[int], RequestResult]]:
    """Submit each turn of every conversation and wait for it; (prompt, result) pairs."""
    workload = Workload(settings)
    params = SamplingParams(max_tokens=settings.max_tokens)
    task = progress.add_task("requests", total=settings.num_conversations * settings.num_turns)
    done: list[tuple[list[int], RequestResult]] = []
    for turn in range(settings.num_turns):
        prompts = workload.next_prompts()
        req_ids = [f"conv{c}-turn{turn}" for c in range(len(prompts))]
        for req_id, prompt in zip(req_ids, prompts, strict=True):
            client.add_request(make_request(req_id, prompt, params))
        results = _wait(client, req_ids, progress, task)
        done.extend(zip(prompts, results, strict=True))
        workload.add_replies([result.token_ids for result in results])
    return done


def _wait(
    client: EngineClient, req_ids: list[str], progress: Progress, task: int
) -> list[RequestResult]:
    num_finished = 0
    while num_finished < len(req_ids):
        client.poll_outputs(PROGRESS_POLL_S)
        now_finished = sum(client.result(req_id).is_finished for req_id in req_ids)
        progress.advance(task, now_finished - num_finished)
        num_finished = now_finished
    return [client.result(req_id) for req_id in req_ids]


def results_table(
    done: list[tuple[list[int], RequestResult]], stats: dict, elapsed_s: float
) -> Table:
    ttfts_ms = sorted(
        1000 * (result.first_token_time - result.submit_time)
        for _, result in done
        if result.first_token_time is not None
    )
    num_tokens = sum(len(result.token_ids) for _, result in done)
    queries = stats.get("prefix_cache_queries", 0) or 0
    hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
    table = Table(title="kvserve demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests", str(len(done))),
        ("output tokens / s", f"{num_tokens / elapsed_s:.1f}"),
        ("TTFT p50 (ms)", f"{statistics.median(ttfts_ms):.1f}" if ttfts_ms else "-"),
        ("TTFT p99 (ms)", f"{percentile(ttfts_ms, 0.99):.1f}" if ttfts_ms else "-"),
        ("prefix-cache hit rate", f"{100 * hit_rate:.1f}%"),
        ("preemptions", str(stats.get("num_preemptions", 0))),
        ("peak KV usage", f"{100 * stats.get('peak_kv_cache_usage', 0.0):.1f}%"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def check_against_reference(
    done: list[tuple[list[int], RequestResult]], settings: DemoSettings
) -> list[str]:
    """The req_ids whose served tokens differ from the reference model's."""
    torch.set_num_threads(1)  # small matrices: more threads only spin against each other
    params = SamplingParams(max_tokens=settings.max_tokens)
    reference = ReferenceModel(settings.model, seed=0)
    return [
        result.req_id
        for prompt, result in done
        if result.error is not None or result.token_ids != reference.generate(prompt, params)
    ]


def run_demo(settings: DemoSettings, log_level: str = "WARNING") -> int:
    """Start the deployment, serve the workload, stop it, then report and check every output."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="kvserve-demo-") as folder:
        engine_config, workers = demo_configs(settings, folder)
        console.print(f"starting an engine and {settings.tp_size} {settings.model} workers (CPU)")
        deployment = Deployment(engine_config, workers, log_level)
        deployment.start()
        try:
            served = _serve(console, engine_config.client_address, settings)
        finally:
            code = deployment.stop()
    if code != 0:
        console.print("[red]the deployment failed; see the log above[/red]")
        return 1
    done, stats, elapsed_s = served
    console.print(results_table(done, stats, elapsed_s))
    start = time.monotonic()
    mismatches = check_against_reference(done, settings)
    console.print(f"checked against the reference model in {time.monotonic() - start:.1f} s")
    if mismatches:
        console.print(
            f"[red]{len(mismatches)} outputs differ from the reference: {mismatches}[/red]"
        )
        return 1
    console.print(f"[green]all {len(done)} outputs match the reference model[/green]")
    return 0


def _serve(
    console: Console, address: str, settings: DemoSettings
) -> tuple[list[tuple[list[int], RequestResult]], dict, float]:
    start = time.monotonic()
    with EngineClient(address, timeout_s=120.0) as client:
        client.check_health()
        console.print(f"engine ready in {time.monotonic() - start:.1f} s")
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        start = time.monotonic()
        with Progress(*columns, console=console) as progress:
            done = run_workload(client, settings, progress)
        elapsed_s = time.monotonic() - start
        stats = client.get_stats()
    return done, stats, elapsed_s
