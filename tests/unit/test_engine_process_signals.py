"""Stop signals against teardowns: the engine's during startup (one while the handshake runs
stops it, one while a failed startup tears down lets that finish), `kvserve launch`'s second
SIGTERM, which must not cut short the stop the first began, and signals after the exit code is
chosen. No sockets, no processes."""

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from deploy.cli import exit_with
from deploy.launch import InterruptOnce
from engine_core.service import engine_process
from engine_core.service.server import EXIT_FAILED, EXIT_OK
from engine_core.workers.rank_watch import WorkerGroupError


class FakeWorkers:
    """Records each shutdown; `on_shutdown` runs first, as a signal arriving midway would."""

    def __init__(self, on_shutdown: Callable[[], None] = lambda: None) -> None:
        self.on_shutdown = on_shutdown
        self.shutdowns: list[tuple[str, bool]] = []

    def shutdown(self, reason: str, is_failure: bool = False) -> None:
        self.on_shutdown()
        self.shutdowns.append((reason, is_failure))


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line of Python


@pytest.fixture(autouse=True)
def restore_stop_handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def start_and_serve(workers: FakeWorkers) -> int:
    try:
        return engine_process._start_and_serve(
            None,  # type: ignore[arg-type]  # start_engine_core is replaced; nothing else reads it
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            [],
            workers,  # type: ignore[arg-type]
            None,
            None,
        )
    except KeyboardInterrupt:  # escaping, it would end the whole test session
        pytest.fail("a stop signal escaped the engine's startup as KeyboardInterrupt")


def test_a_signal_during_a_failed_startups_teardown_lets_it_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(config: object, workers: object) -> None:
        raise WorkerGroupError("rank 1 exited", "exited")

    monkeypatch.setattr(engine_process, "start_engine_core", fail)
    workers = FakeWorkers(on_shutdown=sigterm_self)
    assert start_and_serve(workers) == EXIT_FAILED
    assert workers.shutdowns == [("engine startup failed: rank 1 exited", True)]


def test_a_signal_during_the_handshake_stops_it_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    def handshake(config: object, workers: object) -> None:
        sigterm_self()
        raise AssertionError("the handshake went on after SIGTERM")

    monkeypatch.setattr(engine_process, "start_engine_core", handshake)
    workers = FakeWorkers()
    assert start_and_serve(workers) == EXIT_OK
    assert workers.shutdowns == [("the engine was stopped during startup", False)]


def test_launch_is_interrupted_by_its_first_sigterm_only() -> None:
    on_sigterm = InterruptOnce()
    with pytest.raises(KeyboardInterrupt):
        on_sigterm(signal.SIGTERM, None)
    on_sigterm(signal.SIGTERM, None)  # the deployment is stopping: this one only logs
    assert on_sigterm.is_interrupted


def test_a_process_that_chose_its_exit_code_ignores_later_stop_signals() -> None:
    """Python's finalization would give SIGTERM back its default action: death by signal 15."""
    with pytest.raises(SystemExit) as exited:
        exit_with(1)
    assert exited.value.code == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    sigterm_self()  # ignored: this test goes on
