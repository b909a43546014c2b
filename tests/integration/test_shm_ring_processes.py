"""The shared-memory ring across processes: two reader processes get every frame in order; a
reader killed while the writer waits on it ends the wait at once; a killed writer wakes a
blocked reader; and no segment is left in /dev/shm either way."""

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol.shm_ring import SEGMENT_PREFIX, ReaderState, RingClosedError, RingReaderGoneError
from tests.integration.conftest import ROOT, Processes, wait_for
from tests.integration.shm_ring_peers import frames_for
from worker.shm_ring_reader import SHM_FOLDER, ShmRingReader

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 60.0  # a Python process starting on a loaded 2-core machine
WAIT_S = 60.0
NUM_FRAMES = 400


@pytest.fixture(scope="module", autouse=True)
def resource_tracker_running() -> Iterator[None]:
    """Start this process's resource tracker (which the writer registers its segment with)
    before `processes` takes its census of children, so it is not taken for a leftover."""
    resource_tracker.ensure_running()
    yield


def start_peer(processes: Processes, name: str, *args: object) -> subprocess.Popen:
    log = open(processes.tmp_path / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
    code = "import sys; from tests.integration.shm_ring_peers import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    processes.procs[name] = proc
    return proc


def ring_segments() -> set[str]:
    return {name for name in os.listdir(SHM_FOLDER) if name.startswith(SEGMENT_PREFIX)}


def raised_when_peer_killed(
    blocked_call: Callable[[], object], peer: subprocess.Popen
) -> BaseException:
    """Run `blocked_call` in a thread, SIGKILL `peer`, and return what the call raised: the
    kill must end its wait (the thread must be done within WAIT_S)."""
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            blocked_call()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    peer.send_signal(signal.SIGKILL)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert outcome, "the blocked call returned when its peer was killed"
    return outcome[0]


@pytest.mark.timeout(240)
def test_two_reader_processes_get_every_frame_in_order(processes: Processes) -> None:
    ring = ShmRingWriter(2, num_slots=8, slot_bytes=256)
    try:
        for idx in range(2):
            start_peer(processes, f"reader-{idx}", "checking_reader", ring.name, idx, 7, NUM_FRAMES)
        for frame in frames_for(7, NUM_FRAMES):  # a reader not yet attached holds its frames
            ring.write(frame, WAIT_S)
    finally:
        ring.close()
    for idx in range(2):
        code = processes.wait_exit(f"reader-{idx}", WAIT_S)
        assert code == 0, processes.log(f"reader-{idx}")
    assert ring.name not in ring_segments()


@pytest.mark.timeout(240)
def test_a_killed_reader_ends_the_writer_wait_before_its_deadline(processes: Processes) -> None:
    ring = ShmRingWriter(1, num_slots=4, slot_bytes=64)
    try:
        reader = start_peer(processes, "reader", "idle_reader", ring.name, 0)
        wait_for(
            lambda: ring.reader_states() == [ReaderState.ATTACHED],
            START_TIMEOUT_S,
            "the reader attaching",
        )

        def fill() -> None:
            for _ in range(5):
                ring.write(b"step", WAIT_S)

        error = raised_when_peer_killed(fill, reader)
        assert isinstance(error, RingReaderGoneError), error
        assert f"reader 0 (pid {reader.pid}, attached) exited" in str(error)
    finally:
        ring.close()
    assert processes.wait_exit("reader", WAIT_S) == -signal.SIGKILL
    assert ring.name not in ring_segments()


@pytest.mark.timeout(240)
def test_a_killed_writer_wakes_a_blocked_reader_and_its_segment_goes(
    processes: Processes, tmp_path: Path
) -> None:
    name_file = tmp_path / "ring-name"
    writer = start_peer(processes, "writer", "idle_writer", name_file)
    name = wait_for(lambda: name_file.exists() and name_file.read_text(), START_TIMEOUT_S, "a ring")
    with ShmRingReader(str(name), 0, spin_s=0.0) as reader:
        assert reader.read(WAIT_S) == b"first step"
        error = raised_when_peer_killed(lambda: reader.read(WAIT_S), writer)
    assert isinstance(error, RingClosedError), error
    assert f"(pid {writer.pid}) died" in str(error)
    assert processes.wait_exit("writer", WAIT_S) == -signal.SIGKILL
    # the writer's resource tracker unlinks what the writer left when the writer dies
    wait_for(lambda: name not in ring_segments(), WAIT_S, f"{name} leaving {SHM_FOLDER}")
