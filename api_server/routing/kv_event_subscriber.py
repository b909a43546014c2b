"""KVEventSubscriber: follows every engine's KV-event stream (ZMQ SUB, plus a DEALER to its replay
ROUTER) and keeps the one KVBlockIndex of the front end. Opens sockets; every wait has a deadline.

It replays from its next sequence number on connect, on any gap and, as a heartbeat, whenever the
live stream is quiet; a stream neither source answers for `silent_limit_s` is marked silent.
"""

import asyncio
import contextlib
import logging
import time
import zlib
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from api_server.routing.engine_record import EngineRecord, StreamSource
from api_server.routing.kv_index import KVBlockIndex, Offer
from engine_client.connection import connect_to_engine
from protocol.codec import kv_event_decoder
from protocol.config import CurveKeys
from protocol.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

SEQ_SIZE_BYTES = 8
END_OF_REPLAY = -1  # the seq of a replay's last answer
PROBE_INTERVAL_S = 1.0  # a stream quiet this long is asked for a replay from its next seq
REPLAY_TIMEOUT_S = 5.0  # the longest wait for one frame of a replay answer
DEFAULT_SILENT_LIMIT_S = 5.0  # a stream that answers nothing this long is routed by load alone
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def subscribable_endpoint(bound: str, engine_address: str) -> str:
    """Where to connect to an endpoint an engine bound: a wildcard host becomes the host of the
    engine's client address (or 127.0.0.1 when that is ipc://), other endpoints are kept."""
    scheme, _, rest = bound.partition("://")
    if scheme != "tcp":
        return bound
    host, _, port = rest.rpartition(":")
    if host not in WILDCARD_HOSTS:
        return bound
    engine = urlsplit(engine_address)
    engine_host = engine.hostname if engine.scheme == "tcp" and engine.hostname else "127.0.0.1"
    if ":" in engine_host:  # an IPv6 literal
        engine_host = f"[{engine_host}]"
    return f"tcp://{engine_host}:{port}"


class KVEventSubscriber:
    """One follower task per engine, all applying to `index` on the event loop (so no lock).

    Each engine's stream state (its source and task, silence, replay, gap and restart counts,
    and the digests of the batches applied last) is its record's `kv_events`; KVEventStream states
    the invariants.
    """

    def __init__(
        self,
        records: list[EngineRecord],
        curve: CurveKeys | None = None,
        silent_limit_s: float = DEFAULT_SILENT_LIMIT_S,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        if silent_limit_s <= 0 or probe_interval_s <= 0:
            raise ValueError(
                f"silent limit {silent_limit_s} s, probe interval {probe_interval_s} s: "
                "expected > 0"
            )
        self.records = records
        self.index = KVBlockIndex(records)
        self.curve = curve
        self.silent_limit_s = silent_limit_s
        self.probe_interval_s = probe_interval_s
        self._decoder = kv_event_decoder()
        self._ctx = zmq.asyncio.Context()

    def follow(self, engine_idx: int, source: StreamSource) -> None:
        """Follow engine `engine_idx` at `source`; a changed source restarts its task."""
        stream = self.records[engine_idx].kv_events
        if stream.source == source and stream.task is not None:
            return
        self._stop(engine_idx)
        stream.source = source
        stream.task = asyncio.ensure_future(self._follow(engine_idx, source))

    def _stop(self, engine_idx: int) -> None:
        stream = self.records[engine_idx].kv_events
        if stream.task is not None:
            stream.task.cancel()
        stream.task = None

    async def close(self) -> None:
        tasks = [record.kv_events.task for record in self.records if record.kv_events.task]
        for engine_idx in range(len(self.records)):
            self._stop(engine_idx)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)

    async def _follow(self, engine_idx: int, source: StreamSource) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        connect_to_engine(sub, source.endpoint, self.curve)
        replay: zmq.asyncio.Socket | None = None
        if source.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.DEALER)
            connect_to_engine(replay, source.replay_endpoint, self.curve)
        logger.info("following engine %d's KV events at %s", engine_idx, source.endpoint)
        if replay is None:  # quiet cannot be told from idle, nor a gap healed
            logger.warning(
                "engine %d publishes KV events with no replay_endpoint: a dropped batch stays "
                "lost and its stream is never judged silent",
                engine_idx,
            )
        last_heard_s = time.monotonic()
        try:
            if replay is not None and await self._replay(engine_idx, replay):
                last_heard_s = self._heard(engine_idx)
            while True:
                if await sub.poll(self.probe_interval_s * 1000):
                    frames = await sub.recv_multipart()
                    last_heard_s = self._heard(engine_idx)
                    if self._on_live(engine_idx, frames) and replay is not None:
                        await self._replay(engine_idx, replay)
                elif replay is not None and await self._replay(engine_idx, replay):
                    last_heard_s = self._heard(engine_idx)  # a quiet stream that answers
                if replay is not None:
                    self._check_silence(engine_idx, last_heard_s)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _heard(self, engine_idx: int) -> float:
        stream = self.records[engine_idx].kv_events
        if stream.is_silent:
            logger.info("engine %d's KV events answer: its cache counts in routing", engine_idx)
            stream.is_silent = False
        return time.monotonic()

    def _check_silence(self, engine_idx: int, last_heard_s: float) -> None:
        silent_s = time.monotonic() - last_heard_s
        stream = self.records[engine_idx].kv_events
        if not stream.is_silent and silent_s > self.silent_limit_s:
            stream.is_silent = True
            stream.num_silences += 1
            logger.warning(
                "engine %d's KV events silent for %.1f s: routed by load alone until they resume",
                engine_idx,
                silent_s,
            )

    def _on_live(self, engine_idx: int, frames: list[bytes]) -> bool:
        """Apply one live batch; True when a replay must fill a gap before it."""
        if len(frames) != 3 or len(frames[1]) != SEQ_SIZE_BYTES:
            logger.warning("engine %d sent a KV-event frame of %d parts", engine_idx, len(frames))
            return False
        stream = self.records[engine_idx].kv_events
        seq = int.from_bytes(frames[1], "big")
        if self._is_restart(engine_idx, seq, frames[2]):
            stream.num_restarts += 1
            logger.info("engine %d's KV events started over at seq %d", engine_idx, seq)
            self.index.restart(engine_idx)
            stream.recent.clear()
        outcome = self._offer(engine_idx, seq, frames[2])
        if outcome is Offer.GAP:
            stream.num_gaps += 1
        return outcome is Offer.GAP

    def _is_restart(self, engine_idx: int, seq: int, payload: bytes) -> bool:
        """A live batch behind the index is either one a replay already applied (same payload)
        or the first batches of a new publisher, which counts from 0 again."""
        stream = self.records[engine_idx].kv_events
        if seq >= stream.next_seq:
            return False
        return (seq, zlib.crc32(payload)) not in stream.recent

    def _offer(self, engine_idx: int, seq: int, payload: bytes) -> Offer:
        try:
            batch: KVEventBatch = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("engine %d's KV batch %d does not decode: %s", engine_idx, seq, exc)
            return Offer.STALE
        outcome = self.index.offer(engine_idx, seq, batch)
        if outcome is Offer.APPLIED:
            self.records[engine_idx].kv_events.recent.append((seq, zlib.crc32(payload)))
        return outcome

    async def _replay(self, engine_idx: int, replay: zmq.asyncio.Socket) -> bool:
        """vLLM's replay from the index's next seq: send (b"", seq), apply each (b"", topic, seq,
        payload) until the -1 marker. Whether the end marker came within the deadlines."""
        stream = self.records[engine_idx].kv_events
        start_seq = stream.next_seq
        stream.num_replays += 1
        try:
            request = (b"", start_seq.to_bytes(SEQ_SIZE_BYTES, "big", signed=True))
            await replay.send_multipart(request, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False  # not connected yet
        while True:
            if not await replay.poll(REPLAY_TIMEOUT_S * 1000):
                logger.debug("engine %d: no replay answer in %.1f s", engine_idx, REPLAY_TIMEOUT_S)
                return False
            frames = await replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != SEQ_SIZE_BYTES:
                logger.warning("engine %d sent a replay frame of %d parts", engine_idx, len(frames))
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_OF_REPLAY:
                return True
            if self._offer(engine_idx, seq, frames[3]) is Offer.GAP:
                # the engine no longer keeps what came before seq: take the stream from here
                num_lost = seq - stream.next_seq
                stream.num_lost_batches += num_lost
                logger.warning(
                    "engine %d's replay starts at seq %d: %d batches lost, its index may miss "
                    "blocks until they are used again",
                    engine_idx,
                    seq,
                    num_lost,
                )
                self.index.skip_to(engine_idx, seq)
                self._offer(engine_idx, seq, frames[3])
