"""ApiMetrics: Prometheus text for /metrics, with the front end's own HTTP request counts and
latencies, each engine's get_stats under vLLM's metric names (label `engine`), and the router's
decisions, hit predictions and KV-event index per engine.

One registry per app, never prometheus-client's global one.
"""

import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api_server.openai.token_latency import LATENCY_BUCKETS_S, TokenLatency
from api_server.routing.engine_pool import EnginePool

ASGIMessage = MutableMapping[str, object]
ASGIApp = Callable[
    [ASGIMessage, Callable[[], Awaitable[ASGIMessage]], Callable[[ASGIMessage], Awaitable[None]]],
    Awaitable[None],
]
# get_stats key -> (vLLM's metric name, help, is a counter)
ENGINE_METRICS = {
    "num_running_reqs": ("vllm:num_requests_running", "Requests in the running batch", False),
    "num_waiting_reqs": ("vllm:num_requests_waiting", "Requests waiting to run", False),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full", False),
    "num_preemptions": ("vllm:num_preemptions", "Preemptions", True),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up", True),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found cached", True),
    "num_output_tokens": ("vllm:generation_tokens", "Tokens generated", True),
}


class EngineStatsCollector(Collector):
    """Reports the engine statistics the last scrape fetched; it never waits itself."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.latest: list[dict[str, object] | None] = [None] * len(addresses)

    def collect(self) -> Iterator[Metric]:
        for key, (name, helptext, is_counter) in ENGINE_METRICS.items():
            family_type = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = family_type(name, helptext, labels=["engine"])
            for idx, stats in enumerate(self.latest):
                value = None if stats is None else stats.get(key)
                if isinstance(value, int | float):
                    family.add_metric([str(idx)], float(value))
            yield family
        healthy = GaugeMetricFamily(
            "kvserve:engine_up", "1 while the engine answers", labels=["engine", "address"]
        )
        for idx, stats in enumerate(self.latest):
            healthy.add_metric([str(idx), self.addresses[idx]], 0.0 if stats is None else 1.0)
        yield healthy


class RouterCollector(Collector):
    """The router's counts per engine, read from the pool at each scrape; it never waits."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        records, is_following = self.pool.records, self.pool.subscriber is not None
        engines = [str(record.engine_idx) for record in records]
        streams = [record.kv_events for record in records]
        counters: list[tuple[str, str, list[int]]] = [
            (
                "router_decisions",
                "Requests the router sent to each engine",
                [record.num_decisions for record in records],
            ),
            (
                "router_hit_predictions",
                "Requests whose cache hit the router predicted, then the engine measured",
                [record.num_predicted for record in records],
            ),
            (
                "router_predicted_hit_tokens",
                "Prompt tokens the router expected each engine to find cached",
                [record.predicted_hit_tokens for record in records],
            ),
            (
                "router_actual_hit_tokens",
                "Prompt tokens the engines found cached, for the same requests",
                [record.actual_hit_tokens for record in records],
            ),
        ]
        if is_following:
            counters += [
                (
                    "router_kv_events_replays",
                    "Replays asked of each engine",
                    [stream.num_replays for stream in streams],
                ),
                (
                    "router_kv_events_gaps",
                    "Gaps in each engine's live stream",
                    [stream.num_gaps for stream in streams],
                ),
                (
                    "router_kv_events_silences",
                    "Times each engine's KV-event stream fell silent",
                    [stream.num_silences for stream in streams],
                ),
                (
                    "router_kv_events_lost_batches",
                    "Batches gone from an engine's replay buffer before they were read",
                    [stream.num_lost_batches for stream in streams],
                ),
            ]
        for name, helptext, values in counters:
            family = CounterMetricFamily(f"kvserve:{name}", helptext, labels=["engine"])
            for engine, value in zip(engines, values, strict=True):
                family.add_metric([engine], float(value))
            yield family
        if not is_following:
            return
        blocks = GaugeMetricFamily(
            "kvserve:router_index_blocks", "Blocks the router's index holds", labels=["engine"]
        )
        silent = GaugeMetricFamily(
            "kvserve:router_kv_events_silent",
            "1 while an engine's KV events answer nothing: routed by load alone",
            labels=["engine"],
        )
        for engine, stream in zip(engines, streams, strict=True):
            blocks.add_metric([engine], float(len(stream.keys)))
            silent.add_metric([engine], float(stream.is_silent))
        yield blocks
        yield silent


class ApiMetrics:
    """The registry of one front end. `handlers` bounds the `handler` label: any other path
    counts as `other`."""

    def __init__(self, pool: EnginePool, handlers: set[str]) -> None:
        self.pool = pool
        self.handlers = handlers
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "http_requests",
            "HTTP requests answered by the front end",
            ["handler", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "Time from a request's arrival to its last response byte, in seconds",
            ["handler", "method"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}  # by labels
        self.token_latency = TokenLatency(self.registry)
        self.engines = EngineStatsCollector([record.address for record in pool.records])
        self.registry.register(self.engines)
        self.registry.register(RouterCollector(pool))

    def observe(self, path: str, method: str, status: int, duration_s: float) -> None:
        handler = path if path in self.handlers else "other"
        key = (handler, method, status)
        children = self._children.get(key)
        if children is None:  # labels() parses and locks on every call: look each set up once
            children = (
                self.requests.labels(handler, method, str(status)),
                self.latency.labels(handler, method),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(duration_s)

    async def render(self) -> bytes:
        """The exposition text, with engine statistics fetched now."""
        self.engines.latest = await self.pool.get_stats()
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware that times every HTTP request and records its status."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], ApiMetrics | None]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(
        self,
        scope: ASGIMessage,
        receive: Callable[[], Awaitable[ASGIMessage]],
        send: Callable[[ASGIMessage], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start_s = time.perf_counter()
        status = 500  # unless a response starts

        async def recording_send(message: ASGIMessage) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])  # type: ignore[call-overload]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            metrics = self.metrics()
            if metrics is not None:
                elapsed_s = time.perf_counter() - start_s
                metrics.observe(str(scope["path"]), str(scope["method"]), status, elapsed_s)
