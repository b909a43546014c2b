"""ServedProcess: one HTTP server started in its own session, awaited, measured and stopped.

A server (`kvserve serve`, `vllm serve`) spawns children of its own; every process of the session
the server leads is counted as its own, for CPU time and at shutdown, so that no child (nor a
grandchild left behind by a parent that died) outlives the benchmark. It opens no socket itself
beyond the HTTP readiness probe.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

PROBE_TIMEOUT_S = 2.0
PROBE_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 60.0  # the server's own shutdown after SIGTERM, before its session is killed
KILL_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 4000


class ServedProcess:
    """A server process leading its own session; `log_path` holds its stdout and stderr."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path
    ) -> None:
        self.name = name
        self.port = port
        self.log_path = log_path
        self.start_s = time.monotonic()
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(max(0, self.log_path.stat().st_size - LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")

    def wait_ready(self, timeout_s: float) -> float:
        """Poll GET /health until it answers 200; the seconds since the server was started.
        Raises if the server exits first or stays unready `timeout_s` after this call."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode} during startup; "
                    f"its log ends:\n{self.log_tail()}"
                )
            try:
                answer = httpx.get(f"{self.base_url}/health", timeout=PROBE_TIMEOUT_S)
                if answer.status_code == 200:
                    return time.monotonic() - self.start_s
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} on port {self.port} not healthy in {timeout_s:.0f} s; "
                    f"its log ends:\n{self.log_tail()}"
                )
            time.sleep(PROBE_INTERVAL_S)

    def session_pids(self) -> list[int]:
        """The live (not zombie) processes of the server's session, itself included."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _stat_fields(int(entry))
            # fields after the command: [0] state, [3] session id
            if fields is not None and fields[0] != "Z" and int(fields[3]) == self.process.pid:
                pids.append(int(entry))
        return pids

    def cpu_s(self) -> float:
        """User plus system CPU seconds of the session's live processes, all their threads."""
        ticks = 0
        for pid in self.session_pids():
            fields = _stat_fields(pid)
            if fields is not None:  # [11] utime and [12] stime, in clock ticks
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM the server and wait for its own shutdown; then SIGKILL, by pid, every process
        of its session still alive. Raises if one outlives even that."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # its session is killed below
            self.process.wait(STOP_TIMEOUT_S)
        for pid in self.session_pids():
            with contextlib.suppress(ProcessLookupError):  # it exited since it was listed
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while self.session_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.process.poll() is None:
            self.process.wait(KILL_TIMEOUT_S)
        survivors = self.session_pids()
        if survivors:
            raise RuntimeError(f"{self.name}: processes {survivors} outlived SIGKILL")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold spaces), or None once the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
