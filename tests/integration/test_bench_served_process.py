"""bench/served_process.py: a server is awaited on /health, its CPU is counted over its whole
session, and stopping it leaves no process of that session alive, even a grandchild that
ignores SIGTERM. It starts processes, so it is an integration test."""

import os
import sys
import textwrap
from pathlib import Path

import pytest

from bench.served_process import ServedProcess
from engine_core.net.endpoints import free_tcp_ports

pytestmark = pytest.mark.integration

# A /health server that first starts a child which ignores SIGTERM and writes its pid down.
SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    pid = subprocess.Popen([sys.executable, "-c", child]).pid
    open(sys.argv[2], "w").write(str(pid))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


@pytest.mark.timeout(60)
def test_stop_leaves_no_process_of_the_session(tmp_path: Path) -> None:
    (port,) = free_tcp_ports(1)
    child_pid_path = tmp_path / "child.pid"
    command = [sys.executable, "-c", SERVER, str(port), str(child_pid_path)]
    server = ServedProcess("toy", command, dict(os.environ), port, tmp_path / "toy.log")
    try:
        assert server.wait_ready(timeout_s=30) < 30
        child_pid = int(child_pid_path.read_text())
        assert sorted(server.session_pids()) == sorted([server.process.pid, child_pid])
        assert server.cpu_s() > 0  # the interpreters' own start-up at least
    finally:
        server.stop()
    assert server.process.returncode is not None
    assert server.session_pids() == []
    assert not Path(f"/proc/{child_pid}").exists() or _is_zombie(child_pid)


@pytest.mark.timeout(60)
def test_a_server_that_dies_at_startup_fails_with_its_log(tmp_path: Path) -> None:
    (port,) = free_tcp_ports(1)
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = ServedProcess("broken", command, dict(os.environ), port, tmp_path / "broken.log")
    with pytest.raises(RuntimeError, match="broken exited with 3 during startup") as error:
        server.wait_ready(timeout_s=30)
    assert "no model here" in str(error.value)  # the log's tail comes with the error
    server.stop()


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return False
