"""CURVE without sockets: which addresses count as loopback, the refusal of an exposed address
without keys (and --insecure), the files `kvserve keygen` writes and their modes, and the keys
that --curve-keys-dir loads into each role's config.
"""

import argparse
import stat
from pathlib import Path

import pytest

from deploy.cli import worker_config_from, worker_parser
from deploy.commands import add_subcommands, engine_config_from
from deploy.flags import UsageError
from deploy.keys import keygen, load_curve_keys
from engine_core.net.address import AddressInUseError, is_loopback
from engine_core.net.curve import InsecureAddressError, check_secure
from engine_core.net.endpoints import prepare_ipc_folder
from protocol.config import EngineConfig, KVEventsConfig


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    "address",
    [
        "ipc:///tmp/kvserve/client.sock",
        "ipc://@abstract",
        "inproc://x",
        "tcp://127.0.0.1:5570",
        "tcp://127.1.2.3:5570",
        "tcp://localhost:5570",
        "tcp://[::1]:5570",
    ],
)
def test_loopback_and_ipc_addresses_need_no_keys(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://*:5570",
        "tcp://0.0.0.0:5570",
        "tcp://[::]:5570",
        "tcp://10.0.0.5:5570",
        "tcp://eth0:5570",
        "tcp://engine.example:5570",
        "tcp://128.0.0.1:5570",
    ],
)
def test_other_tcp_addresses_are_reachable_from_other_hosts(address: str) -> None:
    assert not is_loopback(address)


def test_an_exposed_address_without_keys_is_refused_naming_flag_address_and_keygen() -> None:
    config = EngineConfig(client_address="tcp://*:5570")
    with pytest.raises(InsecureAddressError) as excinfo:
        check_secure(config)
    message = str(excinfo.value)
    assert message.startswith("--client-address tcp://*:5570 ")
    assert "kvserve keygen DIR" in message and "--curve-keys-dir DIR" in message
    assert "--insecure" in message and "\n" not in message
    assert isinstance(excinfo.value, AddressInUseError)  # the engine's usage error: exit 2


def test_an_exposed_kv_events_socket_is_refused_too() -> None:
    kv_events = KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="tcp://*:5558")
    with pytest.raises(InsecureAddressError, match="--kv-events-config tcp://\\*:5557"):
        check_secure(EngineConfig(kv_events=kv_events))


def test_an_exposed_kv_transfer_address_of_a_prefill_engine_is_refused_too() -> None:
    exposed = EngineConfig(kv_role="prefill", kv_transfer_address="tcp://10.0.0.1")
    with pytest.raises(InsecureAddressError, match=r"--kv-transfer-address tcp://10\.0\.0\.1:0"):
        check_secure(exposed)
    check_secure(EngineConfig(kv_role="prefill", kv_transfer_address="tcp://127.0.0.1"))
    check_secure(EngineConfig(kv_role="decode", kv_transfer_address="tcp://10.0.0.1"))


def test_insecure_or_keys_or_loopback_bind_anywhere(tmp_path: Path) -> None:
    check_secure(EngineConfig())  # ipc:// defaults
    check_secure(EngineConfig(worker_address="tcp://127.0.0.1:5560"))
    check_secure(EngineConfig(worker_address="tcp://*:5560", allow_insecure=True))
    keygen(tmp_path)
    keys = load_curve_keys(tmp_path, "engine")
    check_secure(EngineConfig(worker_address="tcp://*:5560", curve=keys))


def test_keygen_writes_every_keypair_with_owner_only_secrets(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    keygen(folder)
    assert mode(folder) == 0o700 and mode(folder / "authorized") == 0o700
    for role in ("engine", "worker", "client"):
        assert mode(folder / f"{role}.key_secret") == 0o600
        assert mode(folder / f"{role}.key") == 0o644
    assert sorted(p.name for p in (folder / "authorized").iterdir()) == ["client.key", "worker.key"]
    assert b"secret-key" not in (folder / "authorized" / "worker.key").read_bytes()


def test_keygen_refuses_to_overwrite_secret_keys_without_force(tmp_path: Path) -> None:
    keygen(tmp_path)
    before = load_curve_keys(tmp_path, "engine")
    with pytest.raises(UsageError, match=r"engine\.key_secret exists: pass --force"):
        keygen(tmp_path)
    assert load_curve_keys(tmp_path, "engine") == before
    keygen(tmp_path, is_forced=True)
    after = load_curve_keys(tmp_path, "engine")
    assert after.secret_key != before.secret_key
    assert set(after.authorized_keys).isdisjoint(before.authorized_keys)


def test_each_role_loads_its_keypair_and_the_engines_public_key(tmp_path: Path) -> None:
    keygen(tmp_path)
    engine = load_curve_keys(tmp_path, "engine")
    worker = load_curve_keys(tmp_path, "worker")
    client = load_curve_keys(tmp_path, "client")
    assert engine.server_public_key == engine.public_key
    assert worker.server_public_key == client.server_public_key == engine.public_key
    assert sorted(engine.authorized_keys) == sorted([worker.public_key, client.public_key])
    assert worker.authorized_keys == client.authorized_keys == []
    assert len({engine.secret_key, worker.secret_key, client.secret_key}) == 3
    assert all(len(key) == 40 for key in (engine.public_key, worker.secret_key))


def test_a_missing_key_folder_is_a_usage_error_saying_how_to_make_keys(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--curve-keys-dir .*run `kvserve keygen"):
        load_curve_keys(tmp_path / "nowhere", "worker")


def test_the_flags_put_the_keys_and_metrics_host_in_the_configs(tmp_path: Path) -> None:
    keygen(tmp_path)
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="command"))
    argv = ["launch", "--curve-keys-dir", str(tmp_path), "--metrics-host", "0.0.0.0"]
    engine = engine_config_from(parser.parse_args(argv))
    assert engine.curve == load_curve_keys(tmp_path, "engine")
    assert engine.metrics_host == "0.0.0.0" and not engine.allow_insecure
    assert engine_config_from(parser.parse_args(["launch", "--insecure"])).allow_insecure
    assert EngineConfig().metrics_host == "127.0.0.1"
    args = worker_parser().parse_args(["--curve-keys-dir", str(tmp_path)])
    assert worker_config_from(args, {}).curve == load_curve_keys(tmp_path, "worker")


def test_an_ipc_folder_the_engine_makes_is_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "made" / "here"
    prepare_ipc_folder(f"ipc://{folder}/client.sock")
    assert mode(folder) == 0o700
    tmp_path.joinpath("kept").mkdir(mode=0o755)
    prepare_ipc_folder(f"ipc://{tmp_path}/kept/client.sock")
    assert mode(tmp_path / "kept") == 0o755  # the operator's folder is left as it is
