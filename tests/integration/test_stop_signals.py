"""Stop signals that keep arriving (a launcher seeing the ranks leave, a supervisor repeating
itself) against real processes: an engine whose startup failed finishes its teardown and exits 1,
and a stopping `kvserve launch` drains its requests and exits 0."""

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_port, launch, wait_for
from tests.integration.fake_rank import FakeRank
from tests.integration.hostile import MODEL
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

SIGNAL_GAP_S = 0.0001
LAUNCHER_SIGNAL_GAP_S = 0.002
# The metrics server's loop wakes every 0.5 s from its start, just before the handshake's clock
# starts. Failing 1.25 s in, its stop (part of the teardown) waits about 0.25 s for the loop.
HANDSHAKE_TIMEOUT_S = "1.25"


@pytest.mark.timeout(60)
def test_sigterms_during_a_failed_startups_teardown_let_it_finish(
    processes: Processes, tmp_path: Path
) -> None:
    """Guards against the handler raising KeyboardInterrupt once startup has failed, which cut the
    teardown short, and against a late SIGTERM turning exit status 1 into death by signal.

    A tp=2 engine whose rank 1 never comes; SIGTERM every SIGNAL_GAP_S from the moment rank 0 is
    told to exit (the teardown's first act) until the engine is gone."""
    worker, metrics_port = tmp_path / "worker.sock", free_tcp_port()
    args = ["-tp", "2", "--client-address", f"ipc://{tmp_path}/client.sock"]
    args += ["--worker-address", f"ipc://{worker}", "--metrics-port", str(metrics_port)]
    core = processes.start(
        "core", "core_main", [*args, "--handshake-timeout-s", HANDSHAKE_TIMEOUT_S]
    )
    ctx = zmq.Context()
    rank0 = FakeRank(ctx, f"ipc://{worker}")
    rank0.hello(0, 2, "checksum")
    assert rank0.expect_shutdown().is_failure
    deadline = time.monotonic() + 30
    while core.poll() is None and time.monotonic() < deadline:
        os.kill(core.pid, signal.SIGTERM)
        time.sleep(SIGNAL_GAP_S)
    code = processes.wait_exit("core", 30)
    ctx.destroy(linger=0)
    log = processes.log("core")
    assert code == 1, f"exit status {code}:\n{log[-3000:]}"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert log[log.index("startup failed: ") :].count("signal 15: stopping"), "none landed"
    assert not worker.exists(), "the teardown's last step, removing the ipc files, never ran"
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", metrics_port)),
    ):
        pass  # the metrics server was closed


def storm(proc: subprocess.Popen, gap_s: float) -> threading.Thread:
    """SIGTERM `proc` every `gap_s` until it exits (at most a minute), from a thread."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(gap_s)

    thread = threading.Thread(target=run, name="sigterm-storm", daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_sigterms_to_a_stopping_launcher_let_it_drain_and_exit_0(
    processes: Processes, addresses: dict
) -> None:
    """Guards against a second SIGTERM cutting `kvserve launch`'s stop short: the first begins the
    drain, and the ones after it (every 2 ms, until the launcher is gone) only log."""
    launcher = launch(processes, addresses, 1, MODEL)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompts = {f"drain-{i}": [30 + i, 5, 6] for i in range(3)}
    with EngineClient(addresses["client"], 60.0) as client:
        for req_id, prompt in prompts.items():
            client.add_request(make_request(req_id, prompt, params))
        wait_for(lambda: client.poll_outputs(0.1) or client.result("drain-0").token_ids, 30, "go")
        stormer = storm(launcher, LAUNCHER_SIGNAL_GAP_S)
        results = client.run_until_finished(list(prompts), 60)
    assert processes.wait_exit("launch", 60) == 0, processes.log("launch")[-3000:]
    stormer.join(10)
    for req_id, prompt in prompts.items():
        assert results[req_id].error is None, results[req_id].error
        assert results[req_id].token_ids == reference_generate(MODEL, prompt, params)
    log = processes.log("launch")
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "already stopping" in log, log[-3000:]
