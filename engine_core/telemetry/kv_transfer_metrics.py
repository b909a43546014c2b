"""Prometheus metrics of disaggregated prefill and decode (DESIGN.md §12), fed from the engine's
`KVTransferAgent.stats` totals: a prefill engine's held blocks and handles, a decode engine's pulls,
their bytes, latency and failures. An engine of role "both" reports none of them."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol.client_messages import StatValue

PULL_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# (stat key, metric name, help): each counter follows one total of KVTransferAgent.stats
COUNTED = (
    ("kv_transfer_handles", "kvserve:kv_transfer_handles", "handles given out by a prefill engine"),
    ("kv_transfer_released", "kvserve:kv_transfer_released", "held transfers released early"),
    (
        "kv_transfer_expired",
        "kvserve:kv_transfer_expired",
        "held transfers freed at --kv-transfer-timeout-s: their decode side never pulled",
    ),
    (
        "kv_transfer_refused_pulls",
        "kvserve:kv_transfer_refused_pulls",
        "pulls a prefill engine's ranks refused: a forged, stale or foreign handle, another "
        "layout, or a peer with other CURVE keys",
    ),
    ("kv_transfer_pulls", "kvserve:kv_transfer_pulls", "pulls completed on every rank"),
    (
        "kv_transfer_failed_pulls",
        "kvserve:kv_transfer_failures",
        "pulls that failed or were refused: their request computed its prompt",
    ),
    ("kv_transfer_pulled_blocks", "kvserve:kv_transfer_pulled_blocks", "blocks pulled"),
    ("kv_transfer_pulled_bytes", "kvserve:kv_transfer_pulled_bytes", "bytes pulled, all ranks"),
)


class KVTransferMetrics:
    """Invariants: each counter equals the largest total `on_stats` has seen for its key."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.held_blocks = Gauge(
            "kvserve:kv_transfer_held_blocks",
            "blocks a prefill engine holds for decode engines",
            registry=registry,
        )
        self.pull_seconds = Histogram(
            "kvserve:kv_transfer_pull_seconds",
            "a decode engine's request parked to its blocks pulled, s",
            buckets=PULL_BUCKETS_S,
            registry=registry,
        )
        self._counters = [
            (key, Counter(name, text, registry=registry)) for key, name, text in COUNTED
        ]
        self._last = {key: 0 for key, _, _ in COUNTED}

    def on_stats(self, stats: dict[str, StatValue], pull_seconds: list[float]) -> None:
        held = stats.get("kv_transfer_held_blocks")
        if isinstance(held, int):
            self.held_blocks.set(held)
        for key, counter in self._counters:
            total = stats.get(key)
            if isinstance(total, int) and total > self._last[key]:
                counter.inc(total - self._last[key])
                self._last[key] = total
        for seconds in pull_seconds:
            self.pull_seconds.observe(seconds)
