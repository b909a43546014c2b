"""Typed statistics: the KV-cache manager's totals reach the scheduler's SchedulerStats unchanged,
flatten into the `get_stats` dict, and sampled block timings flow from the pool when enabled."""

import pytest
from fake_executor import FakeExecutor, MakeHarness

from deploy.cli import core_parser, engine_config_from
from deploy.flags import UsageError
from engine_core.core import EngineCore
from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_metrics import BlockMetricsCollector
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest, UtilityResult
from protocol.codec import engine_to_client_decoder, make_encoder
from protocol.config import CacheConfig, EngineConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.sampling import SamplingParams
from protocol.stats import (
    BlockResidencyStats,
    EngineStats,
    PrefixCacheStats,
    SchedulerStats,
    stat_values,
)
from protocol.worker_messages import ModelInfo

BLOCK_SIZE = 4
VOCAB_SIZE = 64
MAX_MODEL_LEN = 24  # 6 blocks: small pools still hold one whole request


def _core(num_blocks: int, **cache_fields: object) -> EngineCore:
    groups = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(BLOCK_SIZE, 1, 8, "float32"))]
    model_info = ModelInfo("fake", VOCAB_SIZE, [], MAX_MODEL_LEN, groups)
    cache = CacheConfig(block_size=BLOCK_SIZE, **cache_fields)  # type: ignore[arg-type]
    config = EngineConfig(check_invariants=True, cache=cache).checked()
    executor = FakeExecutor(VOCAB_SIZE, BLOCK_SIZE, config.scheduler.max_num_batched_tokens)
    return EngineCore(config, KVCacheConfig(num_blocks, groups), model_info, executor)


def _run(core: EngineCore, prompts: dict[str, list[int]]) -> None:
    """Serve each prompt for one token, one request at a time, in order."""
    for req_id, prompt in prompts.items():
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        assert core.add_request(EngineCoreRequest(req_id, pack_int32(prompt), params, 0.0)) is None
        for _ in range(100):
            if not core.has_work():
                break
            core.step()
        assert not core.has_work(), f"{req_id} unfinished after 100 steps"


def test_scheduler_stats_carry_the_managers_prefix_cache_totals(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(max_num_seqs=1)
    harness.add("a", list(range(12)), max_tokens=2)
    harness.add("b", list(range(12)), max_tokens=2)
    harness.run()
    stats = harness.core.make_stats()
    assert isinstance(stats, SchedulerStats)
    assert stats.prefix_cache == PrefixCacheStats(requests=2, queries=24, hits=8)
    assert stats.prefix_cache == harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert harness.core.make_stats() == stats, "reading the stats must not change them"
    assert harness.core.reset_prefix_cache() == (True, None)
    assert harness.core.make_stats().prefix_cache.resets == 1


def test_readmissions_after_preemption_are_counted_apart(make_harness: MakeHarness) -> None:
    harness = make_harness(
        num_blocks=7, max_model_len=MAX_MODEL_LEN, reserve_full_prompt=False
    )  # 6 usable blocks
    for idx in range(3):
        harness.add(f"r{idx}", [idx, *range(1, 8)], max_tokens=12)
    harness.run()
    stats = harness.core.make_stats()
    prefix_cache = stats.prefix_cache
    assert stats.num_preemptions > 0, "the pool should force a preemption"
    assert prefix_cache.requests == 3 and prefix_cache.queries == 24
    assert prefix_cache.preempted_requests == stats.num_preemptions
    assert 0 < prefix_cache.preempted_hits <= prefix_cache.preempted_queries


def test_stat_values_keep_the_flat_keys_that_get_stats_callers_read() -> None:
    scheduler = SchedulerStats(1, 2, 0.5, 3, 4, PrefixCacheStats(1, 10, 4, 1, 6, 5, 2))
    stats = EngineStats(scheduler, 2, 40, 90, 0.75, 0)
    values = stat_values(stats)
    assert values == {
        "num_running_reqs": 1,
        "num_waiting_reqs": 2,
        "kv_cache_usage": 0.5,
        "num_preemptions": 3,
        "num_steps": 4,
        "prefix_cache_requests": 1,
        "prefix_cache_queries": 10,
        "prefix_cache_hits": 4,
        "prefix_cache_preempted_requests": 1,
        "prefix_cache_preempted_queries": 6,
        "prefix_cache_preempted_hits": 5,
        "prefix_cache_resets": 2,
        "prefix_cache_host_hits": 0,  # the tiers below the pool: none in this snapshot
        "prefix_cache_disk_hits": 0,
        "prefix_cache_blocks_to_host": 0,
        "prefix_cache_blocks_to_disk": 0,
        "prefix_cache_blocks_from_disk": 0,
        "prefix_cache_blocks_from_host": 0,
        "prefix_cache_disk_read_failures": 0,
        "prefix_cache_disk_write_failures": 0,
        "tp_size": 2,
        "num_engine_steps": 40,
        "num_output_tokens": 90,
        "peak_kv_cache_usage": 0.75,
        "client_backlog_bytes": 0,
        "step_schedule_s": 0.0,
        "step_encode_s": 0.0,
        "step_transport_s": 0.0,
        "step_update_s": 0.0,
        "num_worker_restarts": 0,
        "rank_forward_s": 0.0,
    }
    assert stat_values(scheduler).items() <= values.items()
    frame = make_encoder().encode(UtilityResult(7, True, values))
    assert engine_to_client_decoder().decode(frame) == UtilityResult(7, True, values)


def test_block_metrics_are_off_by_default_and_cost_the_pool_no_collector() -> None:
    core = _core(num_blocks=8)
    assert core.scheduler.kv_cache_manager.block_pool.metrics_collector is None
    _run(core, {"a": list(range(12)), "b": list(range(20, 32)), "c": list(range(40, 52))})
    assert core.take_block_residency() == BlockResidencyStats()


def test_sampled_block_timings_flow_from_the_pool_when_enabled() -> None:
    core = _core(num_blocks=8, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)  # 7 usable
    shared = list(range(12))
    prompts = {"a": shared, "a-again": shared}  # the second hits two of a's blocks
    prompts |= {f"other-{idx}": [idx, *range(1, 12)] for idx in range(1, 5)}
    _run(core, prompts)  # the others need more blocks than are free: cached blocks are evicted
    residency = core.take_block_residency()
    assert residency.lifetimes_s and residency.idle_before_evict_s and residency.reuse_gaps_s
    assert len(residency.lifetimes_s) == len(residency.idle_before_evict_s)
    assert all(
        idle <= life
        for idle, life in zip(residency.idle_before_evict_s, residency.lifetimes_s, strict=True)
    )
    assert core.take_block_residency() == BlockResidencyStats(), "drained"
    core.check_invariants()


@pytest.mark.parametrize(("rate", "num_tracked"), [(1.0, 300), (0.5, 150), (0.3, 100), (0.01, 3)])
def test_sample_rate_tracks_one_allocation_in_round_one_over_rate(
    rate: float, num_tracked: int
) -> None:
    collector = BlockMetricsCollector.from_sample_rate(rate)
    for block_id in range(300):
        collector.on_block_allocated(KVCacheBlock(block_id))
    assert collector.num_tracked_blocks == num_tracked


@pytest.mark.parametrize("rate", [0.0, 1.5])
def test_sample_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match=f"sample_rate must be in \\(0, 1\\], got {rate}"):
        BlockMetricsCollector.from_sample_rate(rate)


def test_kv_cache_metrics_flags_set_the_cache_config() -> None:
    args = ["--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0"]
    cache = engine_config_from(core_parser().parse_args(args)).cache
    assert cache.kv_cache_metrics and cache.kv_cache_metrics_sample == 1.0
    assert engine_config_from(core_parser().parse_args([])).cache == CacheConfig()
    with pytest.raises(UsageError, match=r"--kv-cache-metrics-sample 0\.0"):
        engine_config_from(core_parser().parse_args(["--kv-cache-metrics-sample", "0"]))
