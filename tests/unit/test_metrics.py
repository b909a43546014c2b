"""EngineMetrics turns the step loop's outputs and stats into Prometheus samples."""

from engine_core.metrics import EngineMetrics
from protocol.client_messages import EngineCoreOutput, EngineCoreOutputs, FinishReason


def sample(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, f"{name} is not exported"
    return value


def outputs(*items: EngineCoreOutput) -> dict[bytes, EngineCoreOutputs]:
    return {b"client": EngineCoreOutputs(list(items))}


def test_first_token_is_ttft_and_later_tokens_are_inter_token_latency() -> None:
    metrics = EngineMetrics()
    metrics.on_request(b"client", "a")
    metrics.on_outputs(outputs(EngineCoreOutput("a", [5])))
    metrics.on_outputs(outputs(EngineCoreOutput("a", [6])))
    metrics.on_outputs(outputs(EngineCoreOutput("a", [7], FinishReason.LENGTH)))
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 2
    metrics.check_invariants()
    metrics.on_outputs(outputs(EngineCoreOutput("a", [8])))  # finished: no longer tracked
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 2


def test_two_clients_with_the_same_req_id_are_timed_apart() -> None:
    """Guards against one client's request id shadowing another's: ids are scoped by client."""
    metrics = EngineMetrics()
    metrics.on_request(b"one", "a")
    metrics.on_request(b"two", "a")
    metrics.on_outputs({b"one": EngineCoreOutputs([EngineCoreOutput("a", [5], FinishReason.STOP)])})
    metrics.on_outputs({b"two": EngineCoreOutputs([EngineCoreOutput("a", [5])])})
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 2
    metrics.check_invariants()


def test_a_rejected_request_records_no_latency() -> None:
    metrics = EngineMetrics()
    metrics.on_outputs(outputs(EngineCoreOutput("never-admitted", [], FinishReason.ERROR)))
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 0


def test_counters_follow_the_cumulative_stats_and_gauges_the_current_ones() -> None:
    metrics = EngineMetrics()
    stats = {
        "num_running_reqs": 3,
        "num_waiting_reqs": 1,
        "kv_cache_usage": 0.25,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "num_preemptions": 2,
    }
    metrics.on_stats(stats)
    metrics.on_stats({**stats, "prefix_cache_queries": 150, "num_running_reqs": 0})
    assert sample(metrics, "vllm:num_requests_running") == 0
    assert sample(metrics, "vllm:num_requests_waiting") == 1
    assert sample(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 150
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 40
    assert sample(metrics, "vllm:num_preemptions_total") == 2
