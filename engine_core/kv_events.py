"""KVEventPublisher: KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB
socket in vLLM's layout (topic, 8-byte big-endian sequence number, msgpack KVEventBatch), with a
ROUTER that replays recent batches. A background thread owns both sockets; the step loop only
hands batches to a queue and never blocks.
"""

import logging
import queue
import threading
import time
from collections import deque

import zmq

from protocol.codec import make_encoder
from protocol.config import KVEventsConfig
from protocol.kv_events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

QUEUE_LIMIT = 100_000  # batches waiting for the thread; beyond it the newest are dropped, logged
POLL_MS = 50  # how often the thread looks at its queue and its replay socket
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Publishes each step's events as one numbered batch and keeps the last ones for replay.

    Invariants: sequence numbers start at 0 and grow by one per batch published; `_buffer` holds
    at most `buffer_steps` (seq, payload) pairs, oldest first.
    """

    def __init__(self, ctx: zmq.Context, config: KVEventsConfig) -> None:
        self.config = config
        self.num_dropped = 0
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(QUEUE_LIMIT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s", config.endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events; never blocks (a full queue drops the batch and counts it)."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full: dropped a batch of %d events", len(events))

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event thread still busy after %.1f s", timeout_s)
            return
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _run(self) -> None:
        encoder = make_encoder()
        topic = self.config.topic.encode()
        while True:
            self._answer_replays()
            try:
                batch = self._queue.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))

    def _answer_replays(self) -> None:
        """Answer `(identity, b"", start_seq)` with every kept batch from start_seq, then -1."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a replay request of %d frames", len(frames))
                continue
            identity, start_seq = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def check_invariants(self) -> None:
        seqs = [seq for seq, _ in self._buffer]
        assert seqs == sorted(seqs), f"replay buffer out of order: {seqs[:5]}"
        assert not seqs or seqs[-1] < self._next_seq, f"seq {seqs[-1]} >= next {self._next_seq}"
