"""The network around a prefill rank's KV transfer server (worker/kv_transfer.py): the address it
announces when it binds every interface, and the ZAP handler that admits only the deployment's
worker key under CURVE. It opens sockets: one inproc REP for ZAP, on a thread of its own."""

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("*", "0.0.0.0")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler
ZAP_POLL_MS = 100  # how often the handler's thread checks whether it should stop
CLOSE_TIMEOUT_S = 2.0


def routed_host(peer_address: str | None) -> str:
    """This host's address for a rank that binds every interface: the one on the interface that
    routes to the host of `peer_address` (a tcp:// address; a UDP connect that sends nothing),
    unless that is a loopback address, then the address the host's name resolves to (a
    container's own, under Docker or Kubernetes); 127.0.0.1 when neither is known."""
    if peer_address is not None and peer_address.startswith("tcp://"):
        peer_host = peer_address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((peer_host, 9))
                host = probe.getsockname()[0]
            if not ipaddress.ip_address(host).is_loopback:
                return host
        except (OSError, ValueError):
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TransferZap:
    """The ZAP handler of one transfer context: admits a CURVE peer only when its public key is
    `admitted_key` (the worker keypair every rank of the deployment holds, so decode ranks);
    any other key, a client's or the engine's included, is refused before a frame passes."""

    def __init__(self, ctx: zmq.Context, admitted_key: str, on_refusal: Callable[[], None]) -> None:
        self._admitted = z85.decode(admitted_key.encode())
        self._on_refusal = on_refusal
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, name="kv-transfer-zap", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(ZAP_POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) < 6:  # not a ZAP request: a REP must answer, never with a pass
                sock.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, mechanism = frames[0], frames[1], frames[5]
            key = frames[6] if len(frames) > 6 else b""
            is_admitted = mechanism == b"CURVE" and key == self._admitted
            if not is_admitted:
                self._on_refusal()
                logger.warning("refused a KV transfer peer with an unknown key")
            status = [b"200", b"OK"] if is_admitted else [b"400", b"unknown key"]
            sock.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._sock.close(linger=0)
