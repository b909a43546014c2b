"""Helpers for tests that start real kvserve processes: free ports, ipc paths, deadline waits, and
a check that no child process (grandchildren included) outlives its test.

The test process makes itself a child subreaper, so an orphaned grandchild is re-parented to it
and shows up in the check instead of escaping to init.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports

__all__ = ["free_tcp_ports"]  # the tests import it from here, with the other helpers

ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36
ORPHAN_WAIT_S = 15.0  # children get this long to exit by themselves after a test
POLL_S = 0.05
HEALTH_POLL_S = 1.0  # one check_health try while an engine starts
MAX_IPC_FOLDER_LEN = 80  # leaves room for "/replay.sock" within a Unix socket's 107 bytes


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)


def free_tcp_port() -> int:
    (port,) = free_tcp_ports(1)
    return port


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll `predicate` until it returns something truthy; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"{what} did not happen in {timeout_s} s")


def live_children() -> list[int]:
    """Pids whose parent is this process and that are not zombies (zombies are reaped here)."""
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid != me:
            continue
        if state == "Z":
            _reap(int(entry.name))
        else:
            pids.append(int(entry.name))
    return pids


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # a Popen object reaped it first
        os.waitpid(pid, os.WNOHANG)


class Processes:
    """The processes one test started, with their logs under the test's tmp_path."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self, name: str, entry: str, args: list[str], new_session: bool = False
    ) -> subprocess.Popen:
        """Run `deploy.cli.<entry>` with `args`; stdout and stderr go to tmp_path/<name>.log.

        Ctrl-C works in the child as in a terminal even when this process was started with
        SIGINT ignored (a background job), and `new_session` gives it a process group of its own.
        """
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
        code = (
            "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from deploy.cli import {entry}; sys.exit({entry}(sys.argv[1:]))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        self.procs[name] = proc
        return proc

    def start_script(self, name: str, script: str, args: list[str]) -> subprocess.Popen:
        """Run an installed console script (`kvserve`, ...) exactly as a user types it."""
        path = Path(sys.executable).parent / script
        assert path.exists(), (
            f"{script} is not installed next to {sys.executable}: pip install -e ."
        )
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
        proc = subprocess.Popen([str(path), *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def wait_exit(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{name} still running after {timeout_s} s:\n{self.log(name)[-3000:]}"
            ) from None

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The references these tests compute in this process use tiny matrices: a second intra-op
    thread only spins against the deployment's processes for the same cores (on a loaded 2-core
    host the async-scheduling references took 104 s with two threads, 7 s with one)."""
    import torch  # the tests' references load it anyway

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@contextlib.contextmanager
def checked_processes(log_folder: Path) -> Iterator[Processes]:
    """Processes started in the body, logging under `log_folder`; on leaving, asserts that none
    of them (nor any orphan) lives on.

    Children this process had before (multiprocessing's resource tracker, started by an earlier
    test, or a deployment a whole module shares) are not the body's and are left alone.
    """
    _become_subreaper()
    earlier = set(live_children())

    def new_children() -> list[int]:
        return [pid for pid in live_children() if pid not in earlier]

    procs = Processes(log_folder)
    yield procs
    leftovers = [name for name, proc in procs.procs.items() if proc.poll() is None]
    procs.kill_all()
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while new_children() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    orphans = new_children()
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes still running after the test: {leftovers}"
    assert not orphans, f"child processes left alive after the test: {orphans}"


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Started processes; after the test, asserts that none of them (nor any orphan) lives on."""
    with checked_processes(tmp_path) as procs:
        yield procs


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    """Processes that the tests of one module share (one deployment serving tests that need no
    fresh engine); after the module's last test, asserts that none of them lives on."""
    with checked_processes(tmp_path_factory.mktemp("module")) as procs:
        yield procs


@contextlib.contextmanager
def short_folder(folder: Path) -> Iterator[Path]:
    """A folder for ipc:// socket files: `folder`, or a short one when `folder` is so long that a
    socket path would pass the 107 bytes a Unix socket address holds (a deep $TMPDIR)."""
    if len(str(folder)) <= MAX_IPC_FOLDER_LEN:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="kvs-", dir="/tmp") as short:
        yield Path(short)


def deployment_addresses(ipc_folder: Path) -> dict[str, str]:
    """The client and worker sockets of one deployment under `ipc_folder`, and a free port."""
    return {
        "client": f"ipc://{ipc_folder}/client.sock",
        "worker": f"ipc://{ipc_folder}/worker.sock",
        "master_port": str(free_tcp_port()),
    }


@pytest.fixture
def ipc_folder(tmp_path: Path) -> Iterator[Path]:
    with short_folder(tmp_path) as folder:
        yield folder


@pytest.fixture
def addresses(ipc_folder: Path) -> dict[str, str]:
    return deployment_addresses(ipc_folder)


@pytest.fixture(scope="module")
def module_addresses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`addresses` for a deployment that the tests of one module share."""
    with short_folder(tmp_path_factory.mktemp("ipc")) as folder:
        yield deployment_addresses(folder)


KV_CACHE_MEMORY_BYTES = 1 << 22  # per rank; small models need far less


def launch(
    processes: Processes,
    addresses: dict[str, str],
    tp_size: int,
    model: str,
    *extra: str,
    new_session: bool = False,
) -> subprocess.Popen:
    """`kvserve launch` on ipc sockets under tmp_path, CPU, logging to tmp_path/launch.log."""
    args = [
        "launch",
        "-tp",
        str(tp_size),
        "--model",
        model,
        "--device",
        "cpu",
        "--client-address",
        addresses["client"],
        "--worker-address",
        addresses["worker"],
        "--master-port",
        addresses["master_port"],
        "--kv-cache-memory-bytes",
        str(KV_CACHE_MEMORY_BYTES),
        "--log-level",
        "INFO",
        *extra,
    ]
    return processes.start("launch", "kvserve_main", args, new_session)


def start_core(processes: Processes, addresses: dict[str, str], tp_size: int, *extra: str) -> None:
    """`kvserve-core` alone, as the process `core`, at the given addresses."""
    args = ["-tp", str(tp_size), "--client-address", addresses["client"]]
    processes.start("core", "core_main", [*args, "--worker-address", addresses["worker"], *extra])


def start_worker(
    processes: Processes,
    addresses: dict[str, str],
    rank: int,
    tp_size: int,
    model: str,
    *extra: str,
    kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
) -> None:
    """`kvserve-worker --rank R` alone, as the process `worker-R`, on the CPU."""
    args = ["--rank", str(rank), "-tp", str(tp_size), "--model", model, "--device", "cpu"]
    args += ["--engine-address", addresses["worker"], "--master-port", addresses["master_port"]]
    args += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes), *extra]
    processes.start(f"worker-{rank}", "worker_main", args)


def stop_process(processes: Processes, name: str, timeout_s: float = 30) -> None:
    """SIGTERM the process `name`, as Ctrl-C would, and require a clean exit."""
    processes.procs[name].send_signal(signal.SIGTERM)
    code = processes.wait_exit(name, timeout_s)
    assert code == 0, f"{name} exited {code}:\n{processes.log(name)[-3000:]}"


def stop_launch(processes: Processes) -> None:
    """SIGTERM the launcher, as Ctrl-C would, and require a clean exit."""
    stop_process(processes, "launch")


def wait_while_running(
    processes: Processes, name: str, predicate: Callable[[], object], timeout_s: float, what: str
) -> object:
    """`wait_for(predicate)`, failing at once with its log when the process `name` exits first
    (a refused flag, a port in use) instead of waiting out the deadline."""

    def running_and_ready() -> object:
        if processes.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited:\n{processes.log(name)[-3000:]}")
        return predicate()

    return wait_for(running_and_ready, timeout_s, what)


def wait_engine_serving(
    processes: Processes, client: EngineClient, timeout_s: float, name: str = "launch"
) -> None:
    """Until the engine answers `client`'s check_health, failing at once with the log when the
    process `name` exits first (a refused flag, a pool too small for max_model_len) instead of
    waiting out the client's deadline."""

    def is_serving() -> bool:
        try:
            return client.call_utility("check_health", timeout_s=HEALTH_POLL_S) is True
        except TimeoutError:
            return False

    wait_while_running(processes, name, is_serving, timeout_s, "the engine answering check_health")


def wait_http_healthy(processes: Processes, name: str, url: str, timeout_s: float) -> None:
    """Until the HTTP server `name` at `url` answers /health with 200 (a refused connection
    means not yet), failing at once when it exits."""

    def is_healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_while_running(processes, name, is_healthy, timeout_s, f"{name} answering /health")
