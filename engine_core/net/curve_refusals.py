"""CurveRefusals: logging the peers a CURVE socket turns away before its ZAP handler hears of
them (no key, another mechanism, garbage). ZMQ reports those only as socket-monitor events that
name the local endpoint; the peer's address is read from the connection's fd when it is accepted.

It only reads monitor events and logs; it never touches the watched sockets' traffic.
"""

import logging
import os
import socket
import threading

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)  # EVENT_HANDSHAKE_FAILED_AUTH is a ZAP refusal, which ZapGuard logs with the peer's address
REFUSAL_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS
POLL_MS = 200  # how often the watching thread looks for a stop request
STOP_TIMEOUT_S = 2.0
# A refused peer's connection can close before its ACCEPTED event is read (the thread reading it
# may wait for the GIL): its address is then unknown, and a later retry usually names it.
UNKNOWN_PEER = "an address that closed before it could be read"


def peer_address(fd: int) -> str:
    """The host of the peer on a libzmq connection fd, read through a duplicate (the fd stays
    libzmq's), as ZAP names it; best effort: the connection may already be gone."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            peer = conn.getpeername()
    except OSError:
        return UNKNOWN_PEER
    if isinstance(peer, tuple):
        return peer[0]
    return "a local process"  # ipc://: a Unix socket has no peer name


class CurveRefusals:
    """The refusals on one socket, from its monitor events in order.

    Invariants: `_peers` maps the fds of accepted connections not yet disconnected to their
    peers' addresses; `_failure` is the reason of a failed handshake whose disconnect has not
    come yet. A refused peer retries every reconnect interval, so its refusals are logged the
    1st, 2nd, 4th, 8th... time per host (each retry comes from a new port).
    """

    def __init__(self, flag: str) -> None:
        self.flag = flag  # names the socket in the log, as ZAP refusals do
        self._peers: dict[int, str] = {}
        self._failure: str | None = None
        self._num_refusals: dict[str, int] = {}

    def on_event(self, event: dict) -> bool:
        """Track one event; True when it is the disconnect of a peer just refused."""
        kind, value = event["event"], int(event["value"])
        if kind == zmq.EVENT_ACCEPTED:
            self._peers[value] = peer_address(value)
        elif kind & HANDSHAKE_FAILED_EVENTS:
            self._failure = _describe_failure(kind, value)
        elif kind == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, UNKNOWN_PEER)
            if self._failure is not None:  # the failed connection closes right after its failure
                self._log(peer, self._failure)
                self._failure = None
                return True
        return False

    def _log(self, peer: str, reason: str) -> None:
        count = self._num_refusals[peer] = self._num_refusals.get(peer, 0) + 1
        if count & (count - 1) == 0:
            logger.warning(
                "refused a peer at %s on %s: %s (%d times so far)", peer, self.flag, reason, count
            )

    def check_invariants(self) -> None:
        assert all(count > 0 for count in self._num_refusals.values()), self._num_refusals


def _describe_failure(kind: int, value: int) -> str:
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no CURVE handshake (a peer without keys, or another security mechanism)"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"its CURVE handshake failed ({os.strerror(value)})"  # an errno
    return f"its CURVE handshake failed (protocol error {value:#x})"


class RefusalWatch:
    """A daemon thread that reads the monitors of the engine's CURVE sockets other than the worker
    socket (whose one monitor RankWatch reads) and logs their handshake refusals.

    Each monitor comes from `sock.get_monitor_socket(REFUSAL_EVENTS)`, called by the thread that
    owns `sock`, with the flag that names it. Invariants: each monitor socket is used only by the
    thread while it runs, and closed only after it stopped.
    """

    def __init__(self, monitors: list[tuple[zmq.Socket, str]]) -> None:
        self._monitors = [monitor for monitor, _ in monitors]
        self._refusals = [CurveRefusals(flag) for _, flag in monitors]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="curve-refusals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_monitor = {}
        for monitor, refusals in zip(self._monitors, self._refusals, strict=True):
            poller.register(monitor, zmq.POLLIN)
            by_monitor[monitor] = refusals
        while not self._stop.is_set():
            for monitor in dict(poller.poll(POLL_MS)):
                try:
                    event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.ZMQError:
                    continue
                by_monitor[monitor].on_event(event)

    def close(self) -> None:
        """Stop the thread within STOP_TIMEOUT_S, then close the monitors (a watched socket that
        outlives them only drops its events)."""
        self._stop.set()
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the CURVE refusal thread did not stop in %.1f s", STOP_TIMEOUT_S)
            return  # its sockets stay open rather than be closed under it
        for monitor in self._monitors:
            monitor.close(linger=0)
