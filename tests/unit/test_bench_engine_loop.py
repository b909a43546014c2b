"""The engine-loop benchmark's pure parts: its flags, the commands it starts, and the arithmetic
that turns the engine's get_stats counters into rates, per-step phases and ratio_model_bound."""

from pathlib import Path

import pytest

from bench.engine_loop import (
    HEADLINE_KEY,
    PHASES,
    Reading,
    Sizing,
    commands,
    keyed,
    kv_cache_memory_bytes,
    loop_flags,
    max_tokens_for,
    parse_args,
    slice_figures,
    summary,
    window_figures,
)
from deploy.cli import core_parser, worker_config_from, worker_parser
from deploy.commands import engine_config_from
from protocol.kv_cache_spec import bytes_per_block
from worker.models.registry import get_model_info


def reading(time_s: float, num_steps: int, num_tokens: int, phase_s: list[float]) -> Reading:
    return Reading(time_s, num_steps, num_tokens, 0, dict(zip(PHASES, phase_s, strict=True)))


def test_defaults_run_sync_over_every_size_and_tp() -> None:
    args = parse_args([], ["sync"])
    assert args.modes == ["sync"]
    assert (args.sizes, args.tp) == ([64, 256, 1024], [1, 2])
    assert (args.window_s, args.model_step_ms, args.repeats) == (3.0, 5.0, 5)


def test_async_runs_only_when_the_engine_has_it_and_always_after_the_sync_baseline() -> None:
    assert parse_args([], ["sync", "async"]).modes == ["sync", "async"]
    assert parse_args(["--modes", "async"], ["sync", "async"]).modes == ["sync", "async"]
    assert parse_args(["--modes", "sync"], ["sync", "async"]).modes == ["sync"]
    with pytest.raises(SystemExit) as refused:
        parse_args(["--modes", "async"], ["sync"])
    assert refused.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [["--sizes", "64,x"], ["--sizes", "0"], ["--tp", ""], ["--window-s", "0"], ["--modes", "fast"]],
)
def test_bad_values_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_args(argv, ["sync"])
    assert refused.value.code == 2


def test_a_slice_gives_rates_phases_per_step_and_the_model_bound() -> None:
    """200 steps of 64 tokens in 2 s against a 5 ms model step: half the model-bound rate."""
    before = reading(10.0, 100, 6_400, [1.0, 0.1, 7.0, 0.9])
    after = reading(12.0, 300, 19_200, [1.04, 0.101, 8.2, 0.93])
    figures = slice_figures(before, after, step_s=0.005)
    expected = {
        "steps_per_s": 100.0,
        "output_tokens_per_s": 6_400.0,
        "output_tokens_per_step": 64.0,
        "schedule_us_per_step": 200.0,
        "encode_us_per_step": 5.0,
        "transport_us_per_step": 6_000.0,
        "update_us_per_step": 150.0,
        "engine_us_per_step": 355.0,
        "other_us_per_step": 10_000.0 - 6_355.0,  # a step's wall time less its four phases
        "transport_beyond_model_us_per_step": 1_000.0,
        "ratio_model_bound": 0.5,
    }
    assert figures == pytest.approx(expected)


def test_a_window_reports_the_median_slice_and_refuses_preemptions() -> None:
    readings = [reading(float(t), 100 * t, 6_400 * t, [0.0] * 4) for t in (0, 1, 2)]
    readings.append(reading(4.0, 300, 19_200, [0.0] * 4))  # a slow slice: 50 steps/s
    assert window_figures(readings, 0.005)["steps_per_s"] == 100.0
    preempted = Reading(5.0, 400, 25_600, 1, dict.fromkeys(PHASES, 0.0))
    with pytest.raises(RuntimeError, match="1 preemptions"):
        slice_figures(readings[-1], preempted, 0.005)


def test_keys_name_the_mode_tp_and_size_and_the_headline_comes_first() -> None:
    figures = keyed({"steps_per_s": 150.0, "ratio_model_bound": 0.75}, "async", 2, 256)
    assert figures == {"async_tp2_256_steps_per_s": 150.0, HEADLINE_KEY: 0.75}
    sync = keyed({"ratio_model_bound": 0.5}, "sync", 2, 256)
    ordered = summary(sync | figures, parse_args([], ["sync", "async"]), ["sync", "async"])
    assert list(ordered)[:2] == [HEADLINE_KEY, "ratio_model_bound_sync_tp2_256"]
    assert ordered["modes_run"] == "sync,async"


def test_requests_outlast_the_window_and_fit_the_pool() -> None:
    assert max_tokens_for(window_s=3.0, step_s=0.005) >= 600  # the steps a 3 s window can hold
    assert max_tokens_for(window_s=100.0, step_s=0.001) == 8192 - 8  # the model's max length
    groups = get_model_info("fixed-time", 16).kv_cache_groups
    blocks = 64 * -(-(8 + 100) // 16) + 64  # every request at its longest, and spares
    assert kv_cache_memory_bytes(64, 100, 2) == blocks * bytes_per_block(groups, 2)


def test_the_loop_flag_is_passed_only_once_the_engine_has_async() -> None:
    assert loop_flags("sync", ["sync"]) == []
    assert loop_flags("sync", ["sync", "async"]) == ["--no-async-scheduling"]
    assert loop_flags("async", ["sync", "async"]) == ["--async-scheduling"]


def test_the_engine_and_every_rank_parse_their_commands_and_agree() -> None:
    sizing = Sizing(2, 1024, 2048, 123_456_789, 2.5)
    *ranks, engine = commands(Path("/tmp/x"), sizing, [], master_port=29_600)
    engine_config = engine_config_from(core_parser().parse_args(engine[1:]))
    assert engine_config.tp_size == 2 and engine_config.scheduler.max_num_seqs == 1024
    assert engine_config.worker_address == "ipc:///tmp/x/worker.sock"
    configs = [worker_config_from(worker_parser().parse_args(rank[1:]), {}) for rank in ranks]
    assert [c.rank for c in configs] == [c.local_rank for c in configs] == [0, 1]
    for config in configs:
        assert (config.model, config.model_step_ms, config.device) == ("fixed-time", 2.5, "cpu")
        assert config.engine_address == engine_config.worker_address
        assert config.kv_cache_memory_bytes == engine_config.cache.kv_cache_memory_bytes
        assert config.max_num_batched_tokens == engine_config.scheduler.max_num_batched_tokens
        assert config.block_size == engine_config.cache.block_size
