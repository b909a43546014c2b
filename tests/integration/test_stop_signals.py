"""Stop signals against a real engine whose startup failed: SIGTERMs that keep arriving while it
tears down (a launcher seeing the ranks leave, a supervisor repeating itself) let the teardown
finish, and the exit status stays the failure's."""

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import zmq

from tests.integration.conftest import Processes, free_tcp_port
from tests.integration.fake_rank import FakeRank

pytestmark = pytest.mark.integration

SIGNAL_GAP_S = 0.0001
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
