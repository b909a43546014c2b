"""What deploy/ hands the processes for the CUDA path: LOCAL_RANK and --device-index reach the
worker's config, `kvserve launch` gives each rank its local rank and the engine's step size, and the
engine's pool host-memory limit defaults to a quarter of physical memory, and a prefill engine's
transfer folder to a private one removed after it."""

import os

import pytest

from deploy.cli import worker_config_from, worker_parser
from deploy.flags import UsageError
from deploy.launch import (
    kv_transfer_address_for,
    physical_memory_bytes,
    with_pool_host_memory_limit,
    worker_configs,
)
from protocol.config import EngineConfig, SchedulerConfig, WorkerConfig


def test_torchruns_local_rank_reaches_the_worker_config() -> None:
    args = worker_parser().parse_args(["--model", "checksum"])
    config = worker_config_from(args, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (config.rank, config.tp_size, config.local_rank, config.device_index) == (5, 8, 1, None)
    with pytest.raises(UsageError, match=r"\$LOCAL_RANK 'x': expected an integer"):
        worker_config_from(args, {"LOCAL_RANK": "x"})


def test_device_flags_reach_the_worker_config() -> None:
    argv = [
        "--device-index",
        "0",
        "--distributed-backend",
        "gloo",
        "--max-num-batched-tokens",
        "64",
    ]
    config = worker_config_from(worker_parser().parse_args(argv), {})
    assert (config.device_index, config.distributed_backend) == (0, "gloo")
    assert config.max_num_batched_tokens == 64
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--distributed-backend", "mpi"])


def test_launch_gives_each_rank_its_local_rank_and_the_engines_step_size() -> None:
    engine = EngineConfig(tp_size=3, scheduler=SchedulerConfig(max_num_batched_tokens=96))
    configs = worker_configs(engine, WorkerConfig(model="checksum"))
    assert [config.local_rank for config in configs] == [0, 1, 2]
    assert {config.max_num_batched_tokens for config in configs} == {96}
    assert {config.distributed_backend for config in configs} == {"auto"}


def test_the_pool_limit_defaults_to_a_quarter_of_physical_memory() -> None:
    config = with_pool_host_memory_limit(EngineConfig())
    assert config.max_pool_host_memory_bytes == physical_memory_bytes() // 4
    given = EngineConfig(max_pool_host_memory_bytes=12345)
    assert with_pool_host_memory_limit(given).max_pool_host_memory_bytes == 12345


def test_a_prefill_engine_gets_a_private_transfer_folder_removed_after_it() -> None:
    with kv_transfer_address_for(EngineConfig(kv_role="prefill")) as config:
        assert config.kv_transfer_address is not None
        folder = config.kv_transfer_address.removeprefix("ipc://")
        assert os.path.isdir(folder) and oct(os.stat(folder).st_mode & 0o777) == "0o700"
    assert not os.path.exists(folder)
    given = EngineConfig(kv_role="prefill", kv_transfer_address="tcp://10.0.0.1")
    with kv_transfer_address_for(given) as config:
        assert config is given
    with kv_transfer_address_for(EngineConfig()) as config:
        assert config.kv_transfer_address is None
