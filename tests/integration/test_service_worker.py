"""A real kvserve-worker facing a scripted engine socket: after the handshake, a step out of order
or an undecodable frame makes it say WorkerFailed and exit 1; a Shutdown makes it exit 0, even when
the engine's disconnect is announced before the Shutdown can be read.
"""

import struct
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from protocol.codec import make_encoder, worker_to_engine_decoder
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import (
    CachedRequestData,
    SchedulerOutput,
    Shutdown,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerToEngine,
)
from tests.integration.conftest import Processes, start_worker
from worker.worker import DISCONNECT_DRAIN_MS, EngineGoneError, Worker

pytestmark = pytest.mark.integration

REPLY_WAIT_MS = 30_000
NUM_BLOCKS = 8


class ScriptedEngine:
    """The engine's worker ROUTER, driven by the test one message at a time."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.identity = b""
        self.decoder = worker_to_engine_decoder()

    def recv(self) -> WorkerToEngine:
        assert self.sock.poll(REPLY_WAIT_MS), "the worker said nothing"
        self.identity, frame = self.sock.recv_multipart()
        return self.decoder.decode(frame)

    def send(self, frame: bytes) -> None:
        self.sock.send_multipart((self.identity, frame))

    def handshake(self) -> None:
        """Hello, a KVCacheConfig of NUM_BLOCKS, Ready: the worker now waits for step 1."""
        hello = self.recv()
        assert isinstance(hello, WorkerHello) and hello.rank == 0, hello
        config = KVCacheConfig(NUM_BLOCKS, hello.model_info.kv_cache_groups)
        self.send(make_encoder().encode(config))
        assert self.recv() == WorkerReady(0, NUM_BLOCKS)


@pytest.fixture
def engine(addresses: dict) -> Iterator[ScriptedEngine]:
    ctx = zmq.Context()
    yield ScriptedEngine(ctx, addresses["worker"])
    ctx.destroy(linger=0)


def empty_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [], CachedRequestData(), b"", 0, [], [])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (make_encoder().encode(empty_step(2)), "got step 2 of generation 1, expected step 1 of 1"),
        (b"\xc1 not msgpack", "ProtocolError"),
    ],
    ids=["step-out-of-order", "undecodable-frame"],
)
def test_a_bad_frame_after_the_handshake_is_worker_failed_and_exit_1(
    processes: Processes, addresses: dict, engine: ScriptedEngine, frame: bytes, reason: str
) -> None:
    start_worker(processes, addresses, 0, 1, "checksum")
    engine.handshake()
    engine.send(frame)
    failed = engine.recv()
    assert isinstance(failed, WorkerFailed) and failed.rank == 0, failed
    assert reason in failed.error, failed.error
    assert processes.wait_exit("worker-0", 30) == 1


@pytest.mark.timeout(90)
def test_steps_in_order_then_shutdown_exit_0(
    processes: Processes, addresses: dict, engine: ScriptedEngine
) -> None:
    start_worker(processes, addresses, 0, 1, "checksum")
    engine.handshake()
    for step_id in (1, 2):
        engine.send(make_encoder().encode(empty_step(step_id)))
        reply = engine.recv()
        assert not isinstance(reply, WorkerFailed), reply
        assert reply.step_id == step_id and reply.rank == 0, reply
    engine.send(make_encoder().encode(Shutdown(reason="test done")))
    assert processes.wait_exit("worker-0", 30) == 0


@pytest.mark.timeout(30)
def test_a_shutdown_read_after_the_disconnect_event_still_stops_the_worker(
    addresses: dict, engine: ScriptedEngine
) -> None:
    """libzmq may post the DEALER's disconnect event a moment before the engine's last frame,
    its Shutdown, is readable. Staged here: the event waits on the monitor when the Shutdown is
    sent. The worker must read the Shutdown (exit 0), and call the engine gone only when no frame
    follows the event."""
    ctx = engine.sock.context
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addresses["worker"])
    monitor, event_source = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    monitor.bind("inproc://worker-monitor")
    event_source.connect("inproc://worker-monitor")
    worker = Worker(WorkerConfig(engine_address=addresses["worker"]), sock, monitor)
    sock.send(b"hello")
    engine.identity, _ = engine.sock.recv_multipart()

    def post_disconnect() -> None:
        endpoint = addresses["worker"].encode()
        event_source.send_multipart((struct.pack("=hi", zmq.EVENT_DISCONNECTED, 0), endpoint))

    post_disconnect()
    shutdown = Shutdown(reason="engine stopping")
    sender = threading.Timer(0.05, engine.send, (make_encoder().encode(shutdown),))
    sender.start()
    try:
        assert worker.recv(time.monotonic() + 10, "a step") == shutdown
    finally:
        sender.join()

    post_disconnect()  # an engine that died: nothing follows the event
    started = time.monotonic()
    with pytest.raises(EngineGoneError, match="disconnected"):
        worker.recv(time.monotonic() + 10, "a step")
    assert time.monotonic() - started < DISCONNECT_DRAIN_MS / 1000 + 2
    for socket in (sock, monitor, event_source):
        socket.close(linger=0)
