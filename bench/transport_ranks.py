"""The far side of bench/transport.py: rank processes that decode every step and reply over a
ZMQ DEALER, taking steps either from that DEALER or from the shared-memory ring the engine's
WorkerGroup names in its KVCacheConfig (as worker/worker.py does), and the 1-byte echo processes
behind the floors (one answers over a ring of its own). No model runs.
"""

import os
import socket
from multiprocessing.connection import Connection

import zmq

from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol import PROTOCOL_VERSION
from protocol.buffers import pack_int32
from protocol.codec import engine_to_worker_decoder, make_encoder
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.shm_ring import read_host_id
from protocol.worker_messages import (
    EngineToWorker,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerHello,
    WorkerReady,
)
from worker.shm_ring_reader import ShmRingReader

BLOCK_SIZE = 16
HANDSHAKE_TIMEOUT_S = 60.0
RANK_IDLE_TIMEOUT_S = 60.0  # a rank or echo that hears nothing for this long exits
STEP_TIMEOUT_S = 10.0
GROUPS = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(BLOCK_SIZE, 2, 8, "float32"))]
MODEL_INFO = ModelInfo("transport-bench", 512, [], 4096, GROUPS)
SAMPLED_TOKEN = pack_int32([7])
QUIT = b"q"  # tells an echo process to exit


def reply_for(step: SchedulerOutput, rank: int) -> ModelRunnerOutput:
    """What a rank sends back: one token per scheduled request, in SchedulerOutput order.

    Built the way a worker holds it: the handles as the int32 bytes they arrived in, the sampled
    tokens as one int32 buffer.
    """
    new_handles = pack_int32(req.handle for req in step.scheduled_new_reqs)
    handles = new_handles + step.scheduled_cached_reqs.handles
    sampled = SAMPLED_TOKEN * (len(handles) // 4)
    return ModelRunnerOutput(step.step_id, rank, handles, sampled)


def _connect(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _hello(rank: int, tp_size: int) -> WorkerHello:
    host = socket.gethostname()
    return WorkerHello(
        PROTOCOL_VERSION,
        rank,
        tp_size,
        os.getpid(),
        host,
        "cpu",
        MODEL_INFO,
        1 << 20,
        host_id=read_host_id(),
        is_shm_ring_capable=True,
    )


def attach(config: KVCacheConfig, rank: int) -> ShmRingReader | None:
    """The reader of the ring the engine's KVCacheConfig offers this rank, if any."""
    if config.shm_ring_name is None or rank not in config.shm_ring_reader_ranks:
        return None
    return ShmRingReader(config.shm_ring_name, config.shm_ring_reader_ranks.index(rank))


def next_frame(reader: ShmRingReader | None, sock: zmq.Socket, poller: zmq.Poller) -> bytes | None:
    """The next frame from the ring or, when the ring is idle, from the DEALER; None after
    RANK_IDLE_TIMEOUT_S of silence. The ring goes first, so a step written before a Shutdown
    sent on the DEALER is still read: the worker's loop once the ring is wired in.

    The ring is re-checked for its spin time; only then does the rank block on the DEALER and
    the ring's doorbell together, having told the writer that it sleeps.
    """
    if reader is None:
        return sock.recv() if sock.poll(int(RANK_IDLE_TIMEOUT_S * 1000)) else None
    while True:
        frame = reader.read_if_ready(STEP_TIMEOUT_S)
        if frame is not None:
            return bytes(frame)
        if sock.poll(0):
            return sock.recv()
        if reader.spin():
            continue
        if not reader.begin_sleep():
            continue
        try:
            events = dict(poller.poll(int(RANK_IDLE_TIMEOUT_S * 1000)))
        finally:
            reader.end_sleep()
        if not events:
            return None


def rank_main(address: str, rank: int, tp_size: int) -> None:
    """A rank that handshakes over its DEALER, then decodes every step in full and replies, as
    worker/worker.py does: over the ring the engine's KVCacheConfig offers (steps off it, replies
    in this rank's lane) or, without one, over the DEALER."""
    ctx = zmq.Context()
    sock = _connect(ctx, address)
    reader: ShmRingReader | None = None
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    encoder, decoder = make_encoder(), engine_to_worker_decoder()
    sock.send(encoder.encode(_hello(rank, tp_size)))
    while (frame := next_frame(reader, sock, poller)) is not None:
        message: EngineToWorker = decoder.decode(frame)
        match message:
            case KVCacheConfig() as config:
                offered = attach(config, rank)
                if offered is not None:
                    reader = offered
                    poller.register(reader.fileno(), zmq.POLLIN)
                ready = WorkerReady(rank, config.num_blocks, config.generation, offered is not None)
                sock.send(encoder.encode(ready))
            case SchedulerOutput() as step if reader is not None:
                reader.write_reply(encoder.encode(reply_for(step, rank)), STEP_TIMEOUT_S)
            case SchedulerOutput() as step:
                sock.send(encoder.encode(reply_for(step, rank)))
            case Shutdown():
                break
    if reader is not None:
        reader.close()
    sock.close(linger=0)
    ctx.term()


def pong_main(
    address: str, ring_name: str | None = None, spin_s: float | None = None, reader_idx: int = 0
) -> None:
    """Says hello once so the ROUTER learns its identity, then echoes every frame until QUIT;
    the frames come over the DEALER, or as reader `reader_idx` of the ring `ring_name`
    (spinning `spin_s`, else the reader's default)."""
    ctx = zmq.Context()
    sock = _connect(ctx, address)
    reader = None
    if ring_name is not None:
        reader = ShmRingReader(ring_name, reader_idx)
        if spin_s is not None:
            reader.spin_s = spin_s
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if reader is not None:
        poller.register(reader.fileno(), zmq.POLLIN)
    sock.send(b"h")
    while (frame := next_frame(reader, sock, poller)) not in (None, QUIT):
        sock.send(frame)
    if reader is not None:
        reader.close()
    sock.close(linger=0)
    ctx.term()


def shm_echo_main(ring_name: str, reader_idx: int, conn: Connection) -> None:
    """Echoes every frame of the ring over a ring of its own, whose name goes back on `conn`,
    until QUIT: a round trip with no ZMQ in it at all."""
    reader = ShmRingReader(ring_name, reader_idx)
    with ShmRingWriter(1) as replies:
        conn.send(replies.name)
        while (frame := reader.read(RANK_IDLE_TIMEOUT_S)) != QUIT:
            replies.write(frame, STEP_TIMEOUT_S)
    reader.close()
