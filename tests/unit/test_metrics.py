"""EngineMetrics turns the step loop's outputs and stats into Prometheus samples."""

from engine_core.telemetry.metrics import EngineMetrics
from protocol.client_messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from protocol.stats import BlockResidencyStats, PrefixCacheStats, SchedulerStats

BLOCK_HISTOGRAMS = (
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
)


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


def scheduler_stats(
    num_running_reqs: int = 0, num_preemptions: int = 0, **prefix_cache: int
) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=num_running_reqs,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        num_preemptions=num_preemptions,
        num_steps=7,
        prefix_cache=PrefixCacheStats(**prefix_cache),
    )


def test_counters_follow_the_cumulative_stats_and_gauges_the_current_ones() -> None:
    metrics = EngineMetrics()
    metrics.on_stats(scheduler_stats(3, 2, queries=100, hits=40))
    metrics.on_stats(scheduler_stats(0, 2, queries=150, hits=40))
    assert sample(metrics, "vllm:num_requests_running") == 0
    assert sample(metrics, "vllm:num_requests_waiting") == 1
    assert sample(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 150
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 40
    assert sample(metrics, "vllm:num_preemptions_total") == 2
    metrics.check_invariants()


def test_each_growth_of_a_total_is_counted_once_and_counters_never_fall() -> None:
    """Guards against counting a total twice when the same stats are reported again (the
    loop reports every half second whether or not anything changed)."""
    metrics = EngineMetrics()
    totals = {"preempted_queries": 30, "preempted_hits": 20, "resets": 1}
    for _ in range(3):
        metrics.on_stats(scheduler_stats(num_preemptions=4, queries=9, **totals))
    assert sample(metrics, "vllm:num_preemptions_total") == 4
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 9
    assert sample(metrics, "kvserve:prefix_cache_preempted_queries_total") == 30
    assert sample(metrics, "kvserve:prefix_cache_preempted_hits_total") == 20
    assert sample(metrics, "kvserve:prefix_cache_resets_total") == 1
    metrics.on_stats(scheduler_stats(num_preemptions=1, queries=3))  # a shrunken total is ignored
    assert sample(metrics, "vllm:num_preemptions_total") == 4
    assert sample(metrics, "kvserve:prefix_cache_resets_total") == 1
    metrics.on_stats(scheduler_stats(num_preemptions=6, queries=9, resets=2))
    assert sample(metrics, "vllm:num_preemptions_total") == 6
    assert sample(metrics, "kvserve:prefix_cache_resets_total") == 2
    metrics.check_invariants()


def test_block_residency_observations_fill_the_three_histograms() -> None:
    metrics = EngineMetrics()
    for name in BLOCK_HISTOGRAMS:
        assert sample(metrics, f"{name}_count") == 0
    metrics.on_block_residency(BlockResidencyStats([5.0, 7.0], [3.0], [2.0, 0.5, 1.0]))
    metrics.on_block_residency(BlockResidencyStats())
    counts = [sample(metrics, f"{name}_count") for name in BLOCK_HISTOGRAMS]
    assert counts == [2, 1, 3]
    assert sample(metrics, "vllm:kv_block_lifetime_seconds_sum") == 12.0
