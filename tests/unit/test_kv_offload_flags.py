"""The tier flags (--kv-offload-host-bytes, --kv-offload-disk-dir, --kv-offload-disk-bytes) build
CacheConfig, and a bad combination exits 2 naming the flag before any process starts."""

import os
from pathlib import Path

import pytest

from deploy.cli import core_main, core_parser, engine_config_from, kvserve_main
from deploy.flags import UsageError
from protocol.config import EngineConfig


def engine_config(*argv: str) -> EngineConfig:
    return engine_config_from(core_parser().parse_args(list(argv)))


def test_the_tier_flags_set_the_cache_config(tmp_path: Path) -> None:
    cache = engine_config(
        "--kv-offload-host-bytes",
        "1048576",
        "--kv-offload-disk-dir",
        str(tmp_path),
        "--kv-offload-disk-bytes",
        "4194304",
    ).cache
    assert cache.kv_offload_host_bytes == 1 << 20
    assert cache.kv_offload_disk_bytes == 4 << 20
    assert cache.kv_offload_disk_dir == str(tmp_path)
    assert os.listdir(tmp_path) == []  # the writability check leaves nothing behind
    assert engine_config().cache.kv_offload_host_bytes == 0  # off by default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-offload-host-bytes", "-1"], "--kv-offload-host-bytes -1: expected `int` >= 0"),
        (["--kv-offload-disk-bytes", "-5"], "--kv-offload-disk-bytes -5: expected `int` >= 0"),
        (
            ["--kv-offload-disk-bytes", "4096", "--kv-offload-disk-dir", "{tmp}"],
            "--kv-offload-disk-bytes 4096: a disk tier needs a host tier above it",
        ),
        (
            ["--kv-offload-host-bytes", "4096", "--kv-offload-disk-bytes", "4096"],
            "--kv-offload-disk-bytes 4096: expected --kv-offload-disk-dir",
        ),
        (
            ["--kv-offload-host-bytes", "4096", "--kv-offload-disk-dir", "{tmp}"],
            "--kv-offload-disk-dir {tmp}: expected --kv-offload-disk-bytes > 0 with it",
        ),
        (
            [
                *["--kv-offload-host-bytes", "1", "--kv-offload-disk-bytes", "1"],
                *["--kv-offload-disk-dir", "{tmp}/missing"],
            ],
            "--kv-offload-disk-dir {tmp}/missing: expected a folder this user can write",
        ),
        (  # no file can be made under a regular file, even by root (unlike a read-only folder)
            [
                *["--kv-offload-host-bytes", "1", "--kv-offload-disk-bytes", "1"],
                *["--kv-offload-disk-dir", "{tmp}/a-file"],
            ],
            "--kv-offload-disk-dir {tmp}/a-file: expected a folder this user can write",
        ),
    ],
)
def test_bad_tier_flags_are_usage_errors_naming_the_flag(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    (tmp_path / "a-file").write_bytes(b"")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    with pytest.raises(UsageError, match=message.format(tmp=tmp_path).replace("$", r"\$")):
        engine_config(*argv)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="expected a folder this user can write"):
            engine_config(
                *["--kv-offload-host-bytes", "1", "--kv-offload-disk-bytes", "1"],
                *["--kv-offload-disk-dir", str(tmp_path)],
            )
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize("command", ["kvserve-core", "launch", "serve"])
def test_a_bad_folder_exits_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture, command: str
) -> None:
    flags = ["--kv-offload-host-bytes", "1", "--kv-offload-disk-bytes", "1"]
    flags += ["--kv-offload-disk-dir", str(tmp_path / "missing")]
    with pytest.raises(SystemExit) as exited:
        if command == "kvserve-core":
            core_main(flags)
        else:
            kvserve_main(
                [command, "--model", "checksum", "--kv-cache-memory-bytes", "4096", *flags]
            )
    assert exited.value.code == 2
    assert f"--kv-offload-disk-dir {tmp_path / 'missing'}: expected a folder" in (
        capsys.readouterr().err
    )
