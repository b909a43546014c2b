"""Steps over the shared-memory ring (DESIGN.md §1) in real deployments: same-host ranks read them
off the ring and serve the reference tokens; a rank that cannot map the ring (a /dev/shm of its
own, as in a container) takes them over ZMQ beside one that reads it; a lost rank's generation
gives way to a fresh ring under a new name; and no segment outlives its engine.
"""

import os
import random
import re
import signal
import subprocess
import sys

import pytest

from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from protocol.shm_ring import SEGMENT_PREFIX
from tests.integration.conftest import (
    KV_CACHE_MEMORY_BYTES,
    ROOT,
    Processes,
    launch,
    start_core,
    start_worker,
    stop_launch,
    wait_for,
)
from tests.integration.served_requests import reference_tokens, serve_and_check

pytestmark = pytest.mark.integration

MODEL = "checksum"
CLIENT_TIMEOUT_S = 120.0
SHM_FOLDER = "/dev/shm"


def _serve_and_check(client: EngineClient, seed: int, first_idx: int = 0) -> None:
    """Twelve concurrent requests (`req-<first_idx>` on), greedy and seeded; each must equal the
    reference exactly."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0.8 * (i % 2), seed=i)
        for i in range(len(prompts))
    ]
    expected = reference_tokens(MODEL)
    serve_and_check(client, prompts, params, expected, CLIENT_TIMEOUT_S, first_idx=first_idx)


def _engine_segments(engine_pid: int) -> list[str]:
    """The engine's ring segments still in /dev/shm (each writer's names carry its pid)."""
    prefix = f"{SEGMENT_PREFIX}{engine_pid}-"
    return sorted(name for name in os.listdir(SHM_FOLDER) if name.startswith(prefix))


def _rings(log: str) -> list[tuple[str, str]]:
    """(reader ranks, ring name) of every ring the engine opened, oldest first."""
    return re.findall(r"steps to rank\(s\) (\[[\d, ]*\]) go over ring (\S+)", log)


@pytest.mark.timeout(300)
def test_tp2_over_the_ring_serves_the_reference_and_a_new_generation_gets_a_fresh_ring(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 2, MODEL, "--max-model-len", "512", "--step-timeout-s", "10")
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_for(lambda: client.check_health(), 60, "the deployment to serve")
        log = processes.log("launch")
        engine_pid = int(re.search(r"engine-core \(pid (\d+)\)", log)[1])
        assert _rings(log) == [("[0, 1]", _rings(log)[0][1])], _rings(log)
        assert log.count("steps come over ring") == 2
        _serve_and_check(client, seed=1)
        first_ring = _rings(log)[0][1]
        assert _engine_segments(engine_pid) == [first_ring]

        victim = int(re.findall(r"rank 1 joined: pid (\d+)", log)[-1])
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: "worker generation 2 ready" in processes.log("launch"),
            120,
            "the next worker generation",
        )
        rings = _rings(processes.log("launch"))
        assert len(rings) == 2 and rings[1][0] == "[0, 1]", rings
        assert rings[1][1] != first_ring, "a new generation must get a ring of its own"
        assert _engine_segments(engine_pid) == [rings[1][1]], "the retired ring was not unlinked"
        _serve_and_check(client, seed=2, first_idx=12)
    stop_launch(processes)
    assert _engine_segments(engine_pid) == [], "a ring outlived its engine"


def _start_worker_with_own_dev_shm(processes: Processes, addresses: dict, rank: int) -> None:
    """`kvserve-worker` in a mount namespace with a /dev/shm of its own, as in a container that
    shares the host's boot id but not its shared memory: the engine's ring is not there."""
    args = ["--rank", str(rank), "-tp", "2", "--model", MODEL, "--device", "cpu"]
    args += ["--engine-address", addresses["worker"], "--master-port", addresses["master_port"]]
    args += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)]
    code = "import sys; from deploy.cli import worker_main; sys.exit(worker_main(sys.argv[1:]))"
    script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    log = open(processes.tmp_path / f"worker-{rank}.log", "wb")  # noqa: SIM115  # closed with it
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    processes.procs[f"worker-{rank}"] = subprocess.Popen(
        [*command, sys.executable, "-c", code, *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _can_mount_own_dev_shm() -> bool:
    probe = ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/dev/shm"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _can_mount_own_dev_shm(), reason="needs root and unshare for a mount ns")
def test_a_rank_that_cannot_map_the_ring_takes_its_steps_over_zmq_beside_a_ring_reader(
    processes: Processes, addresses: dict
) -> None:
    start_core(processes, addresses, 2, "--max-model-len", "512")
    start_worker(processes, addresses, 0, 2, MODEL)
    _start_worker_with_own_dev_shm(processes, addresses, 1)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_for(lambda: client.check_health(), 90, "the deployment to serve")
        _serve_and_check(client, seed=3)
        core_log = processes.log("core")
    assert _rings(core_log)[0][0] == "[0, 1]", "both ranks share the engine's boot id"
    assert "rank 1 could not attach to ring" in core_log
    assert "steps come over ring" in processes.log("worker-0")
    assert "cannot read steps off ring" in processes.log("worker-1")
    processes.procs["core"].send_signal(signal.SIGTERM)
    assert processes.wait_exit("core", 30) == 0
    for rank in (0, 1):
        assert processes.wait_exit(f"worker-{rank}", 30) == 0
    ring_name = _rings(core_log)[0][1]
    assert ring_name not in os.listdir(SHM_FOLDER), "the ring outlived its engine"
