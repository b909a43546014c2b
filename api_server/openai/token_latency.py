"""TokenLatency: vLLM's time-to-first-token and inter-token latency histograms, which serving
observes as it streams; the app's /metrics registry (api_server/metrics.py) holds them."""

from prometheus_client import CollectorRegistry, Histogram

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TokenLatency:
    """vLLM's TTFT and inter-token latency histograms, timed where the client sees the tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from a request's start to its first token, in seconds",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of one request, in seconds",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
