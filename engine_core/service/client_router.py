"""ClientRouter: the engine's client ROUTER socket. It reads a bounded share of client frames
between steps, answers frames it cannot decode, and delivers each client's outputs in order,
keeping a bounded backlog for a slow reader. It never decides about requests; the server does.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from protocol.client_messages import (
    ClientToEngine,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    UtilityResult,
)
from protocol.codec import client_to_engine_decoder, make_encoder
from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

MALFORMED_REQ_ID = "<malformed>"  # names a rejected frame that carried no readable req_id
PROBE_INTERVAL_S = 0.5  # a client with live requests hears from the engine at least this often
TCP_KEEPALIVE_IDLE_S = 10  # a remote client whose host vanished is dropped by the kernel
TCP_KEEPALIVE_INTERVAL_S = 2
TCP_KEEPALIVE_COUNT = 5


class _FrameIds(msgspec.Struct):
    """What a malformed frame may still say about itself: typed, so decoding it cannot fail in
    any way other than the ones caught below."""

    req_id: str | None = None
    call_id: int | None = None


def readable_ids(decoder: msgspec.msgpack.Decoder, frame: bytes) -> tuple[str | None, int | None]:
    """The req_id and call_id `frame` names, or None for each it does not name readably; any
    frame whatever, nested a million deep included, gets an answer rather than an exception."""
    try:
        ids = decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError):
        return None, None
    return ids.req_id, ids.call_id


def frame_ids_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(_FrameIds)


@dataclass(slots=True, frozen=True)
class MalformedFrame:
    """A client frame that did not decode, and why."""

    reason: str
    frame: bytes


@dataclass(slots=True)
class ClientBacklog:
    """Encoded outputs waiting for a client whose connection is full, oldest first."""

    frames: deque[bytes] = field(default_factory=deque)
    size_bytes: int = 0
    is_over_bound: bool = False  # set when size_bytes passed the bound; cleared once drained
    num_dropped: int = 0  # frames dropped past twice the bound


class ClientRouter:
    """The client side of the engine: fair bounded reads, ordered bounded writes.

    Invariants: a client has a backlog only while frames wait in it, and then every new output to
    it goes behind them; `size_bytes` is the sum of its frames' sizes; `left` and `stalled` name
    clients once each until the server takes them.
    """

    def __init__(self, sock: zmq.Socket, max_backlog_bytes: int, max_frames_per_step: int) -> None:
        self.sock = sock
        self.max_backlog_bytes = max_backlog_bytes
        self.max_frames_per_step = max_frames_per_step
        self.backlogs: dict[bytes, ClientBacklog] = {}
        self.left: set[bytes] = set()  # clients found gone, for the server to abort
        self.stalled: set[bytes] = set()  # clients whose backlog passed the bound, likewise
        self._last_sent: dict[bytes, float] = {}  # time.monotonic() of the last delivery
        self._encoder = make_encoder()
        self._decoder = client_to_engine_decoder()
        self._ids_decoder = frame_ids_decoder()

    @staticmethod
    def configure(sock: zmq.Socket, max_frame_bytes: int, linger_ms: int) -> None:
        """Options that must be set before bind: they are copied into every connection."""
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a client that left fails at once
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # larger frames never reach Python
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_COUNT)

    # -- input ---------------------------------------------------------------------------------

    def receive(self) -> list[tuple[bytes, ClientToEngine | MalformedFrame]]:
        """At most max_frames_per_step frames, decoded or as the error that rejects them.

        The ROUTER queues fairly across connections, so a client that floods the engine gets
        its turn, not the whole step: everyone else's frames are read in the same rounds.
        """
        received: list[tuple[bytes, ClientToEngine | MalformedFrame]] = []
        for _ in range(self.max_frames_per_step):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                reason = f"expected 1 frame after the identity, got {len(frames) - 1}"
                received.append((frames[0], MalformedFrame(reason, b"")))
                continue
            identity, frame = frames
            try:
                received.append((identity, self._decoder.decode(frame)))
            except ProtocolError as exc:
                received.append((identity, MalformedFrame(str(exc), frame)))
        return received

    def frame_ids(self, frame: bytes) -> tuple[str | None, int | None]:
        """The req_id and call_id a malformed frame names, when it names them readably."""
        return readable_ids(self._ids_decoder, frame)

    def reject_malformed(
        self, identity: bytes, malformed: MalformedFrame, req_id: str | None, call_id: int | None
    ) -> None:
        """Answer a frame that failed to decode, under the req_id or call_id it names (see
        frame_ids; the server passes None for a req_id a live request of the client holds, since
        that request did nothing wrong), else under MALFORMED_REQ_ID."""
        reason = malformed.reason
        logger.warning("rejected a malformed frame: %s", reason[:200])
        if call_id is not None and 0 <= call_id < 2**63:
            self.send(identity, UtilityResult(call_id, False, error=reason))
            return
        if not req_id or len(req_id) > 256:
            req_id = MALFORMED_REQ_ID
        output = EngineCoreOutput(req_id, [], FinishReason.ERROR, error=reason)
        self.send(identity, EngineCoreOutputs([output], timestamp=time.time()))

    # -- output --------------------------------------------------------------------------------

    def send(self, identity: bytes, message: EngineCoreOutputs | UtilityResult) -> None:
        """Deliver now, or queue behind the client's backlog; a client that left is noted."""
        frame = self._encoder.encode(message)
        backlog = self.backlogs.get(identity)
        if backlog is None:
            try:
                self.sock.send_multipart((identity, frame), zmq.NOBLOCK)
                self._last_sent[identity] = time.monotonic()
                return
            except zmq.Again:  # its connection is full: the client reads slower than we write
                backlog = self.backlogs[identity] = ClientBacklog()
            except zmq.ZMQError as exc:
                self._note_left(identity, exc)
                return
        self._queue(identity, backlog, frame)

    def _queue(self, identity: bytes, backlog: ClientBacklog, frame: bytes) -> None:
        if backlog.size_bytes >= 2 * self.max_backlog_bytes:
            # Only a stalled client that keeps sending gets here: its rejections have no reader.
            backlog.num_dropped += 1
            if backlog.num_dropped == 1:
                logger.warning("client %s reads nothing: dropping its new outputs", identity.hex())
            return
        backlog.frames.append(frame)
        backlog.size_bytes += len(frame)
        if backlog.size_bytes > self.max_backlog_bytes and not backlog.is_over_bound:
            backlog.is_over_bound = True
            self.stalled.add(identity)

    def flush(self) -> None:
        """Move backlogged outputs into the connections that have room again, in order."""
        for identity in list(self.backlogs):
            backlog = self.backlogs[identity]
            try:
                while backlog.frames:
                    self.sock.send_multipart((identity, backlog.frames[0]), zmq.NOBLOCK)
                    backlog.size_bytes -= len(backlog.frames.popleft())
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                self._note_left(identity, exc)
                continue
            del self.backlogs[identity]
            self._last_sent[identity] = time.monotonic()

    def is_stalled(self, identity: bytes) -> bool:
        backlog = self.backlogs.get(identity)
        return backlog is not None and backlog.is_over_bound

    def probe(self, identities: list[bytes]) -> None:
        """Send an empty output batch to each client in `identities` (those with live requests)
        not written to lately: a client that left fails the send at once (ROUTER_MANDATORY), so
        its requests can be aborted before they are ever scheduled."""
        now = time.monotonic()
        self._last_sent = {i: self._last_sent[i] for i in identities if i in self._last_sent}
        for identity in identities:
            is_quiet = now - self._last_sent.get(identity, 0.0) >= PROBE_INTERVAL_S
            if is_quiet and identity not in self.backlogs:
                self.send(identity, EngineCoreOutputs([], timestamp=time.time()))

    def take_left(self) -> list[bytes]:
        left, self.left = list(self.left), set()
        return left

    def take_stalled(self) -> list[bytes]:
        stalled, self.stalled = list(self.stalled), set()
        return stalled

    def _note_left(self, identity: bytes, exc: zmq.ZMQError) -> None:
        logger.info("client %s left (%s): aborting its requests", identity.hex(), exc.strerror)
        self.backlogs.pop(identity, None)
        self._last_sent.pop(identity, None)
        self.left.add(identity)

    def forget(self, identity: bytes) -> None:
        """Drop what is kept for a client that left, once its requests are aborted."""
        self.backlogs.pop(identity, None)
        self._last_sent.pop(identity, None)

    @property
    def backlog_bytes(self) -> int:
        return sum(backlog.size_bytes for backlog in self.backlogs.values())

    def check_invariants(self) -> None:
        for identity, backlog in self.backlogs.items():
            assert backlog.frames, f"client {identity.hex()} has an empty backlog"
            size = sum(len(frame) for frame in backlog.frames)
            assert size == backlog.size_bytes, (
                f"client {identity.hex()} backlog holds {size} bytes, counted {backlog.size_bytes}"
            )
