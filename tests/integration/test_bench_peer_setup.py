"""bench/peers/setup.sh, docs/benchmarks.md's way to build the vLLM peer environment, is a
runnable script that refuses bad arguments before it installs anything.
It starts bash, so it is an integration test."""

import os
import pathlib
import subprocess

import pytest

SETUP = pathlib.Path(__file__).resolve().parents[2] / "bench" / "peers" / "setup.sh"
TIMEOUT_S = 10.0

pytestmark = pytest.mark.integration


def test_setup_script_is_executable_bash_that_parses() -> None:
    assert os.access(SETUP, os.X_OK), f"{SETUP} is not executable"
    assert SETUP.read_text().startswith("#!/usr/bin/env bash\n")
    subprocess.run(["bash", "-n", str(SETUP)], check=True, timeout=TIMEOUT_S)


def test_setup_script_without_a_directory_prints_its_usage_and_exits_2() -> None:
    for args in ([], ["a", "b"], ["--help"]):
        done = subprocess.run(
            ["bash", str(SETUP), *args], capture_output=True, text=True, timeout=TIMEOUT_S
        )
        assert done.returncode == 2, (args, done.returncode)
        assert done.stderr.startswith("usage: bash bench/peers/setup.sh DIR"), done.stderr
