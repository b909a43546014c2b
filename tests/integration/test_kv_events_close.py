"""KVEventPublisher.close on real ZMQ sockets: it returns within its deadline, never raises, and
leaves no socket open, so the engine's `ctx.term()` returns, whatever the publisher's thread does.
"""

import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine_core.telemetry import kv_events
from engine_core.telemetry.kv_events import LOCK_TIMEOUT_S, KVEventPublisher
from protocol.config import KVEventsConfig
from protocol.kv_events import KVCacheEvent, block_stored

pytestmark = pytest.mark.integration

CLOSE_TIMEOUT_S = 0.5
SLACK_S = 0.5  # scheduling noise allowed on top of close()'s own bound
TERM_TIMEOUT_S = 5.0
WEDGE_TIMEOUT_S = 20.0  # the wedged encoder gives up by itself, so no test thread outlives us
EVENTS = [block_stored([bytes(32)] * 8, None, list(range(128)), 16, 0)]


class WedgedEncoder:
    """An encoder whose first call blocks until released: the thread stuck mid-batch."""

    def __init__(self) -> None:
        self.is_entered = threading.Event()
        self.release = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: object) -> bytes:
        self.is_entered.set()
        self.release.wait(WEDGE_TIMEOUT_S)
        return self._encoder.encode(message)


def events_config(ipc_folder: Path) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{ipc_folder}/kv.sock",
        replay_endpoint=f"ipc://{ipc_folder}/replay.sock",
    )


def silent_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A subscriber that never reads, with the smallest receive queue."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def timed_close(publisher: KVEventPublisher) -> float:
    start = time.monotonic()
    publisher.close(CLOSE_TIMEOUT_S)
    return time.monotonic() - start


def assert_term_returns(ctx: zmq.Context) -> None:
    """ctx.term() blocks while any socket of ctx is open; run it where a hang cannot stop us."""
    term = threading.Thread(target=ctx.term, name="ctx-term", daemon=True)
    term.start()
    term.join(TERM_TIMEOUT_S)
    assert not term.is_alive(), f"ctx.term() still blocked after {TERM_TIMEOUT_S} s"


@pytest.mark.timeout(30)
def test_close_returns_in_time_with_a_wedged_thread_and_a_full_queue(
    ipc_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards against close() raising queue.Full on a full queue (which skipped the rest of the
    engine's cleanup) and returning with its sockets open (which blocked ctx.term() forever)."""
    encoder = WedgedEncoder()
    monkeypatch.setattr(kv_events, "QUEUE_LIMIT", 4)
    monkeypatch.setattr(kv_events, "make_encoder", lambda: encoder)
    config = events_config(ipc_folder)
    ctx = zmq.Context()
    sub = silent_subscriber(ctx, config.endpoint)
    publisher = KVEventPublisher(ctx, config)
    try:
        publisher.publish(EVENTS)
        assert encoder.is_entered.wait(TERM_TIMEOUT_S), "the thread never took the first batch"
        for _ in range(4 + 1):
            publisher.publish(EVENTS)
        assert publisher.num_dropped == 1, "the queue of 4 should have dropped the fifth batch"
        elapsed_s = timed_close(publisher)
        assert elapsed_s < CLOSE_TIMEOUT_S + LOCK_TIMEOUT_S + SLACK_S, f"close took {elapsed_s} s"
        assert publisher.num_dropped == 1 + 4, "the queued batches are counted as dropped"
        sub.close()
        assert_term_returns(ctx)
    finally:
        encoder.release.set()
    publisher._thread.join(TERM_TIMEOUT_S)
    assert not publisher._thread.is_alive(), "the released thread did not see the close"


@pytest.mark.timeout(30)
def test_close_publishes_the_queue_to_a_subscriber_that_never_reads(ipc_folder: Path) -> None:
    config = events_config(ipc_folder)
    ctx = zmq.Context()
    sub = silent_subscriber(ctx, config.endpoint)
    publisher = KVEventPublisher(ctx, config)
    num_batches = 3000  # far past both high-water marks and the ipc buffer: sends are dropped
    events: list[KVCacheEvent] = list(EVENTS)
    for _ in range(num_batches):
        publisher.publish(events)
    elapsed_s = timed_close(publisher)
    assert elapsed_s < CLOSE_TIMEOUT_S + LOCK_TIMEOUT_S + SLACK_S, f"close took {elapsed_s} s"
    assert publisher.num_dropped + publisher._next_seq == num_batches
    assert publisher._next_seq > 0, "close published nothing of the queue"
    publisher.close(CLOSE_TIMEOUT_S)  # a second close is a no-op
    sub.close()
    assert_term_returns(ctx)
