"""Prometheus metrics and the HTTP /metrics and /health endpoints of the engine.

Metric names mirror vLLM's (`vllm:num_requests_running`, ...) so existing dashboards read them.
The HTTP server runs in a daemon thread and only reads; the step loop never waits on it.
"""

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from protocol.client_messages import EngineCoreOutputs, StatValue

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """The engine's Prometheus metrics, fed by the step loop.

    Invariants: `_first_seen` holds exactly the requests that have not finished since the loop
    reported them; `is_healthy` is True only between a completed handshake and a failure.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "requests running", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1", registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up", registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "prompt tokens served from cache", registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "requests preempted", registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "arrival to first token, s",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "between output tokens, s",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.step_time = Histogram(
            "kvserve:step_duration_seconds",
            "one engine step, s",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.is_healthy = False
        # (client id, req_id) -> arrival at the engine, then the time of its last token
        self._first_seen: dict[tuple[bytes, str], float] = {}
        self._has_token: set[tuple[bytes, str]] = set()
        self._totals = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

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

    def on_stats(self, stats: dict[str, StatValue]) -> None:
        """Set the gauges and advance the counters to the engine's cumulative totals."""
        self.running.set(float(stats.get("num_running_reqs") or 0))
        self.waiting.set(float(stats.get("num_waiting_reqs") or 0))
        self.kv_usage.set(float(stats.get("kv_cache_usage") or 0.0))
        for key, counter in (
            ("prefix_cache_queries", self.queries),
            ("prefix_cache_hits", self.hits),
            ("num_preemptions", self.preemptions),
        ):
            total = int(stats.get(key) or 0)
            if total > self._totals[key]:
                counter.inc(total - self._totals[key])
                self._totals[key] = total

    def check_invariants(self) -> None:
        stray = self._has_token - set(self._first_seen)
        assert not stray, f"requests with tokens but no arrival time: {sorted(stray)[:5]}"


class MetricsServer:
    """HTTP /metrics (Prometheus text) and /health (200 while healthy, else 503) on a port."""

    def __init__(self, metrics: EngineMetrics, port: int, host: str = "0.0.0.0") -> None:
        handler = _make_handler(metrics)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="metrics-http", daemon=True
        )
        self.thread.start()
        logger.info("serving /metrics and /health on port %d", self.httpd.server_address[1])

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
