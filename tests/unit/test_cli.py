"""The command-line flags build the typed configs: defaults from the configs, bounds checked,
bad values a usage error (exit 2) naming the flag, the value and the range."""

import logging

import pytest

from deploy.cli import core_parser, engine_config_from, worker_config_from, worker_parser
from deploy.commands import LAUNCH_WORKER_FLAGS
from deploy.flags import UsageError
from deploy.launch import worker_configs
from deploy.logs import setup_logging
from protocol.config import EngineConfig, SchedulingPolicy, WorkerConfig


def engine_config(*argv: str) -> EngineConfig:
    return engine_config_from(core_parser().parse_args(list(argv)))


def worker_config(*argv: str, environ: dict[str, str] | None = None) -> WorkerConfig:
    return worker_config_from(worker_parser().parse_args(list(argv)), environ or {})


def test_no_flags_give_the_config_defaults() -> None:
    assert engine_config() == EngineConfig()
    assert worker_config() == WorkerConfig()


def test_flags_set_nested_config_fields() -> None:
    config = engine_config(
        "-tp",
        "2",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "100",
        "--step-timeout-s",
        "2.5",
    )
    assert config.tp_size == 2
    assert config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.cache.num_gpu_blocks_override == 100
    assert config.scheduler.scheduling_policy is SchedulingPolicy.PRIORITY
    assert config.scheduler.max_model_len == 1024
    assert config.step_timeout_s == 2.5


def test_host_and_port_make_a_tcp_client_address() -> None:
    assert (
        engine_config("--host", "0.0.0.0", "--port", "8100").client_address == "tcp://0.0.0.0:8100"
    )


def test_kv_events_config_is_json() -> None:
    config = engine_config("--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.kv_events.enable_kv_cache_events is True
    assert config.kv_events.topic == "kv"
    with pytest.raises(UsageError, match="--kv-events-config"):
        engine_config("--kv-events-config", '{"no_such_field": 1}')


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--block-size", "0"], "--block-size 0: expected `int` >= 1"),
        (["-tp", "65"], "--tensor-parallel-size 65: expected `int` <= 64"),
        (
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization 1.5: expected `float` <= 1.0",
        ),
        (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override 1: expected `int` >= 2"),
    ],
)
def test_out_of_range_flag_is_a_usage_error_naming_flag_value_and_range(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture
) -> None:
    from deploy.cli import core_main

    with pytest.raises(SystemExit) as exited:
        core_main(argv)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_unknown_choice_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["launch", "--scheduling-policy", "random"])
    assert exited.value.code == 2
    assert "--scheduling-policy" in capsys.readouterr().err


def test_launch_with_a_bad_flag_exits_2(capsys: pytest.CaptureFixture) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["launch", "--max-num-seqs", "0"])
    assert exited.value.code == 2
    assert "--max-num-seqs 0" in capsys.readouterr().err


def test_help_texts_give_default_range_and_unit() -> None:
    text = core_parser().format_help()
    assert "tokens per KV-cache block; range >= 1 and <= 1024; default 16" in " ".join(text.split())


def test_worker_reads_torchrun_environment_and_flags_win() -> None:
    environ = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29611"}
    config = worker_config(environ=environ)
    assert (config.rank, config.tp_size, config.master_addr, config.master_port) == (
        1,
        4,
        "10.0.0.5",
        29611,
    )
    assert worker_config("--rank", "3", environ=environ).rank == 3


def test_enforce_eager_turns_graphs_off_on_a_worker_and_through_launch() -> None:
    assert worker_config("--enforce-eager").enforce_eager
    assert (
        not worker_config().enforce_eager and not worker_config("--no-enforce-eager").enforce_eager
    )
    assert "--enforce-eager" in [name for flag in LAUNCH_WORKER_FLAGS for name in flag.names]


def test_bad_torchrun_environment_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="RANK"):
        worker_config(environ={"RANK": "one"})
    with pytest.raises(UsageError, match="--rank -1"):
        worker_config("--rank", "-1")


def test_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["launch", "--model", "gpt-9", "--kv-cache-memory-bytes", "1000"])
    assert exited.value.code == 2
    assert "--model gpt-9: expected one of ['checksum'" in capsys.readouterr().err


def test_launch_gives_every_rank_the_engine_settings() -> None:
    engine = engine_config(
        "-tp",
        "3",
        "--block-size",
        "8",
        "--kv-cache-memory-bytes",
        "4096",
        "--worker-address",
        "ipc:///tmp/w.sock",
    )
    configs = worker_configs(engine, WorkerConfig(model="checksum"))
    assert [config.rank for config in configs] == [0, 1, 2]
    for config in configs:
        assert config.tp_size == 3 and config.block_size == 8
        assert config.kv_cache_memory_bytes == 4096 and config.model == "checksum"
        assert config.engine_address == "ipc:///tmp/w.sock"


def test_log_lines_carry_the_process_name(capsys: pytest.CaptureFixture) -> None:
    setup_logging("worker-1", "INFO")
    logging.getLogger("kvserve.test").info("ready: %d blocks", 7)
    assert "INFO [worker-1] kvserve.test: ready: 7 blocks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="log level"):
        setup_logging("engine", "LOUD")


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--model", "gpt-9"], "--model gpt-9"), (["--log-level", "LOUD"], "--log-level")],
)
def test_demo_with_a_bad_flag_exits_2_before_starting_anything(
    capsys: pytest.CaptureFixture, argv: list[str], named: str
) -> None:
    """An unknown model used to start the deployment and fail in the workers (exit 1)."""
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["demo", *argv])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
