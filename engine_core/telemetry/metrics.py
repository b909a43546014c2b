"""Prometheus metrics and the HTTP /metrics and /health endpoints of the engine.

Metric names mirror vLLM's (`vllm:num_requests_running`, ...) so existing dashboards read them.
The HTTP server runs in a daemon thread and only reads; the step loop never waits on it.
"""

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine_core.telemetry.kv_transfer_metrics import KVTransferMetrics
from protocol.client_messages import EngineCoreOutputs
from protocol.stats import BlockResidencyStats, SchedulerStats

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Blocks live from milliseconds (a busy pool) to hours (a hot shared prefix).
RESIDENCY_BUCKETS_S = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class EngineMetrics:
    """The engine's Prometheus metrics, fed by the step loop.

    Invariants: `_first_seen` holds exactly the requests that have not finished since the loop
    reported them; `is_healthy` is True only between a completed handshake and a failure; each
    counter of `_counted` equals the largest total `on_stats` has seen for it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_scheduler_metrics(self.registry)
        self._add_latency_metrics(self.registry)
        self._add_block_metrics(self.registry)
        self.worker_restarts = Counter(
            "kvserve:worker_restarts",
            "worker generations replaced after a rank fault, by cause",
            ["cause"],
            registry=self.registry,
        )
        self.worker_recovery = _histogram(
            "kvserve:worker_recovery_seconds",
            "a rank fault to the next worker generation ready, s",
            (*LATENCY_BUCKETS_S, 60.0, 120.0, 300.0),
            self.registry,
        )
        self.kv_transfer = KVTransferMetrics(self.registry)  # P/D, DESIGN.md §12
        self.is_healthy = False
        # (client id, req_id) -> arrival at the engine, then the time of its last token
        self._first_seen: dict[tuple[bytes, str], float] = {}
        self._has_token: set[tuple[bytes, str]] = set()

    def _add_scheduler_metrics(self, r: CollectorRegistry) -> None:
        self.running = Gauge("vllm:num_requests_running", "requests running", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1", registry=r)
        queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up", registry=r)
        hits = Counter("vllm:prefix_cache_hits", "prompt tokens served from cache", registry=r)
        preemptions = Counter("vllm:num_preemptions", "requests preempted", registry=r)
        preempted_queries = Counter(
            "kvserve:prefix_cache_preempted_queries",
            "prompt tokens looked up by requests re-admitted after preemption",
            registry=r,
        )
        preempted_hits = Counter(
            "kvserve:prefix_cache_preempted_hits",
            "prompt tokens of re-admitted preempted requests served from cache",
            registry=r,
        )
        resets = Counter("kvserve:prefix_cache_resets", "prefix cache clears", registry=r)
        host_hits = Counter(
            "kvserve:prefix_cache_host_hits",
            "prompt tokens of the hits copied in from the host tier",
            registry=r,
        )
        disk_hits = Counter(
            "kvserve:prefix_cache_disk_hits",
            "prompt tokens of the hits found in the disk tier (not counted as host hits)",
            registry=r,
        )
        moved = Counter(
            "kvserve:kv_offload_blocks",
            "blocks copied between the device pool and the tiers below it, by direction",
            ["direction"],
            registry=r,
        )
        disk_failures = Counter(
            "kvserve:kv_offload_disk_failures",
            "disk-tier slots that failed (checksum on read, or the write), now misses",
            ["op"],
            registry=r,
        )
        # Each counter follows one total of SchedulerStats and advances by that total's growth
        # since the last `on_stats`: the one place where increments are computed.
        self._counted: list[tuple[Counter, Callable[[SchedulerStats], int]]] = [
            (queries, lambda stats: stats.prefix_cache.queries),
            (hits, lambda stats: stats.prefix_cache.hits),
            (preemptions, lambda stats: stats.num_preemptions),
            (preempted_queries, lambda stats: stats.prefix_cache.preempted_queries),
            (preempted_hits, lambda stats: stats.prefix_cache.preempted_hits),
            (resets, lambda stats: stats.prefix_cache.resets),
            (host_hits, lambda stats: stats.prefix_cache.host_hits),
            (disk_hits, lambda stats: stats.prefix_cache.disk_hits),
            (moved.labels("device_to_host"), lambda stats: stats.prefix_cache.blocks_to_host),
            (moved.labels("host_to_disk"), lambda stats: stats.prefix_cache.blocks_to_disk),
            (moved.labels("disk_to_host"), lambda stats: stats.prefix_cache.blocks_from_disk),
            (moved.labels("host_to_device"), lambda stats: stats.prefix_cache.blocks_from_host),
            (disk_failures.labels("read"), lambda stats: stats.prefix_cache.disk_read_failures),
            (disk_failures.labels("write"), lambda stats: stats.prefix_cache.disk_write_failures),
        ]
        self._last_totals = [0] * len(self._counted)

    def _add_latency_metrics(self, r: CollectorRegistry) -> None:
        self.ttft = _histogram(
            "vllm:time_to_first_token_seconds", "arrival to first token, s", LATENCY_BUCKETS_S, r
        )
        self.itl = _histogram(
            "vllm:inter_token_latency_seconds", "between output tokens, s", LATENCY_BUCKETS_S, r
        )
        self.step_time = _histogram(
            "kvserve:step_duration_seconds", "one engine step, s", LATENCY_BUCKETS_S, r
        )

    def _add_block_metrics(self, r: CollectorRegistry) -> None:
        """Timings of sampled KV-cache blocks; they stay empty without --kv-cache-metrics."""
        self.block_lifetime = _histogram(
            "vllm:kv_block_lifetime_seconds",
            "sampled KV-cache block, allocation to eviction, s",
            RESIDENCY_BUCKETS_S,
            r,
        )
        self.block_idle_before_evict = _histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "sampled KV-cache block, last access to eviction, s",
            RESIDENCY_BUCKETS_S,
            r,
        )
        self.block_reuse_gap = _histogram(
            "vllm:kv_block_reuse_gap_seconds",
            "sampled KV-cache block, one access to its next prefix-cache hit, s",
            RESIDENCY_BUCKETS_S,
            r,
        )

    def on_request(self, client_id: bytes, req_id: str) -> None:
        self._first_seen[client_id, req_id] = time.monotonic()

    def on_outputs(self, outputs: dict[bytes, EngineCoreOutputs]) -> None:
        """Record TTFT and inter-token latency from one step's outputs."""
        now = time.monotonic()
        for client_id, client_outputs in outputs.items():
            for output in client_outputs.outputs:
                key = (client_id, output.req_id)
                last = self._first_seen.get(key)
                if last is None:
                    continue
                if output.new_token_ids:
                    latency = self.itl if key in self._has_token else self.ttft
                    latency.observe(now - last)
                    self._has_token.add(key)
                    self._first_seen[key] = now
                if output.finish_reason is not None:
                    del self._first_seen[key]
                    self._has_token.discard(key)

    def on_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges, and advance each counter by the growth of its total since last time."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        last_totals = self._last_totals
        for idx, (counter, total_of) in enumerate(self._counted):
            total = total_of(stats)
            if total > last_totals[idx]:  # totals never shrink; a counter must not either
                counter.inc(total - last_totals[idx])
                last_totals[idx] = total

    def on_worker_restart(self, cause: str, recovery_s: float) -> None:
        self.worker_restarts.labels(cause=cause).inc()
        self.worker_recovery.observe(recovery_s)

    def on_block_residency(self, residency: BlockResidencyStats) -> None:
        """Observe the sampled block timings drained from the KV-cache manager."""
        for histogram, values_s in (
            (self.block_lifetime, residency.lifetimes_s),
            (self.block_idle_before_evict, residency.idle_before_evict_s),
            (self.block_reuse_gap, residency.reuse_gaps_s),
        ):
            for value_s in values_s:
                histogram.observe(value_s)

    def check_invariants(self) -> None:
        stray = self._has_token - set(self._first_seen)
        assert not stray, f"requests with tokens but no arrival time: {sorted(stray)[:5]}"
        for (counter, _), total in zip(self._counted, self._last_totals, strict=True):
            (family,) = counter.collect()
            value = family.samples[0].value
            assert value == total, f"counter {family.name} is {value}, its last total {total}"


def _histogram(
    name: str, documentation: str, buckets_s: tuple[float, ...], registry: CollectorRegistry
) -> Histogram:
    return Histogram(name, documentation, buckets=buckets_s, registry=registry)


class MetricsServer:
    """HTTP /metrics (Prometheus text) and /health (200 while healthy, else 503) on a port."""

    def __init__(self, metrics: EngineMetrics, port: int, host: str = "127.0.0.1") -> None:
        handler = _make_handler(metrics)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="metrics-http", daemon=True
        )
        self.thread.start()
        logger.info(
            "serving /metrics and /health on %s port %d", host, self.httpd.server_address[1]
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(metrics: EngineMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server dispatches to
            if self.path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            elif self.path == "/health":
                healthy = metrics.is_healthy
                self._reply(
                    200 if healthy else 503, "text/plain", b"ok\n" if healthy else b"dead\n"
                )
            else:
                self._reply(404, "text/plain", b"not found: expected /metrics or /health\n")

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("http: " + format, *args)

    return Handler
