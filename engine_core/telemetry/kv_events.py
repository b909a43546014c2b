"""KVEventPublisher: KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB
socket in vLLM's layout (topic, 8-byte big-endian sequence number, msgpack KVEventBatch), with a
ROUTER that answers vLLM's replay requests. A background thread owns both sockets; the step loop
only hands batches to a queue and never blocks.
"""

import logging
import queue
import threading
import time
from collections import deque

import zmq

from engine_core.net.curve import make_curve_server
from engine_core.net.curve_refusals import REFUSAL_EVENTS
from protocol.codec import make_encoder
from protocol.config import CurveKeys, KVEventsConfig
from protocol.kv_events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

QUEUE_LIMIT = 100_000  # batches waiting for the thread; beyond it the newest are dropped, logged
POLL_MS = 50  # how often the thread looks at its queue and its replay socket
CLOSE_TIMEOUT_S = 2.0  # close() returns within this, plus LOCK_TIMEOUT_S
DRAIN_SHARE = 0.5  # share of close()'s timeout the thread may spend publishing what is queued
LOCK_TIMEOUT_S = 0.5  # the thread holds the socket lock for one send or one replay answer
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the seq frame of a replay's last answer
SEQ_SIZE_BYTES = 8
KV_EVENTS_FLAG = "--kv-events-config"  # names both sockets in errors and ZAP refusals
DATA_PARALLEL_RANK = 0  # vLLM's publisher stamps its rank on every batch; kvserve is one engine


class KVEventPublisher:
    """Publishes each step's events as one numbered batch and keeps the last ones for replay.

    Invariants: sequence numbers start at 0 and grow by one per batch published; `_buffer` holds
    at most `buffer_steps` (seq, payload) pairs, oldest first. Both belong to the thread, which
    uses the sockets only under `_lock` and only while `_is_closed` is False.

    Neither socket ever blocks a send: PUB drops a message for a subscriber at its high-water mark,
    and ROUTER (without ROUTER_MANDATORY) drops one for a peer that is full or gone. So the lock is
    held only briefly, and close() can always take it and close the sockets.
    """

    def __init__(
        self, ctx: zmq.Context, config: KVEventsConfig, curve: CurveKeys | None = None
    ) -> None:
        self.config = config
        self.num_dropped = 0
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(QUEUE_LIMIT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._lock = threading.Lock()  # held around every zmq call, so close() never races one
        self._is_closed = False
        self._stop = threading.Event()
        self._drain_until_s = 0.0  # monotonic; set by close() before _stop
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        make_curve_server(self._pub, curve, KV_EVENTS_FLAG)  # subscribers need authorized keys
        self._pub.bind(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # ZMQ frees room in a peer's queue only every half high-water mark, so a queue of
            # twice the replay (plus its end marker) never drops part of one answer.
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            make_curve_server(self._replay, curve, KV_EVENTS_FLAG)
            self._replay.bind(config.replay_endpoint)
        # Monitors for RefusalWatch, made before the thread owns the sockets: with CURVE, a
        # subscriber without keys is refused in its handshake, which only a monitor reports.
        self.refusal_monitors: list[tuple[zmq.Socket, str]] = []
        if curve is not None:
            for sock in filter(None, [self._pub, self._replay]):
                self.refusal_monitors.append(
                    (sock.get_monitor_socket(REFUSAL_EVENTS), KV_EVENTS_FLAG)
                )
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s", config.endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events; never blocks (a full queue drops the batch and counts it)."""
        if not events:
            return
        try:
            batch = KVEventBatch(time.time(), events, DATA_PARALLEL_RANK)
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full: dropped a batch of %d events", len(events))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Publish what is queued while time allows, stop the thread and close both sockets.

        Returns within about `timeout_s` + LOCK_TIMEOUT_S whatever state the thread is in, and
        never raises: batches still queued then are dropped (logged), and the sockets are closed
        with linger 0 even when the thread has not finished, so that `ctx.term()` returns.
        """
        if self._is_closed:
            return
        start_s = time.monotonic()
        deadline_s = start_s + timeout_s
        self._drain_until_s = start_s + timeout_s * DRAIN_SHARE
        self._stop.set()  # after _drain_until_s: the Event orders the two for the thread
        self._thread.join(max(0.0, deadline_s - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("KV event thread still busy after %.1f s: closing under it", timeout_s)
        is_locked = self._lock.acquire(timeout=LOCK_TIMEOUT_S)
        if not is_locked:  # unreachable while every zmq call of the thread is non-blocking
            logger.error("KV event sockets still in use after %.1f s: closing", LOCK_TIMEOUT_S)
        try:
            self._is_closed = True
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
        finally:
            if is_locked:
                self._lock.release()
        num_unsent = self._queue.qsize()
        if num_unsent:
            self.num_dropped += num_unsent
            logger.warning("KV event publisher closed with %d batches unsent", num_unsent)

    def _run(self) -> None:
        encoder = make_encoder()
        topic = self.config.topic.encode()
        while True:
            if not self._answer_replays():
                return
            if self._stop.is_set() and (
                self._queue.empty() or time.monotonic() >= self._drain_until_s
            ):
                return
            try:
                batch = self._queue.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            payload = encoder.encode(batch)
            with self._lock:
                if self._is_closed:
                    return
                seq = self._next_seq
                self._next_seq += 1
                self._buffer.append((seq, payload))
                self._pub.send_multipart((topic, seq.to_bytes(SEQ_SIZE_BYTES, "big"), payload))

    def _answer_replays(self) -> bool:
        """Answer each `(identity, b"", start_seq)` as vLLM's replay does, then the -1 marker.

        Every kept batch from start_seq goes out as `(identity, b"", topic, seq, payload)`, the
        end as `(identity, b"", b"", -1, b"")`. Takes the lock per request, so close() waits at
        most one answer; False once closed.
        """
        topic = self.config.topic.encode()
        while True:
            with self._lock:
                if self._is_closed:
                    return False
                replay = self._replay
                if replay is None or not replay.poll(0):
                    return True
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != SEQ_SIZE_BYTES:
                    logger.warning("ignored a replay request of %d frames", len(frames))
                    continue
                identity, start_seq = frames[0], int.from_bytes(frames[2], "big", signed=True)
                if start_seq < 0:  # vLLM reads it unsigned, past every batch: none is replayed
                    logger.warning("replay from seq %d: answered with the end marker", start_seq)
                kept = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq >= 0]
                for seq, payload in kept:
                    seq_bytes = seq.to_bytes(SEQ_SIZE_BYTES, "big")
                    replay.send_multipart((identity, b"", topic, seq_bytes, payload))
                replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))
