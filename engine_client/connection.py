"""The DEALER connection every client of the engine opens: its deadline by default, its linger on
close, CURVE client keys, and the TCP keepalive that finds a vanished remote host. It only
configures and connects a socket; reading and writing it are the clients'.
"""

import zmq

from protocol.config import CurveKeys

DEFAULT_TIMEOUT_S = 60.0
CLOSE_LINGER_MS = 1000  # close() delivers what was sent (an abort, say) within this long
# A dead engine on this host closes the connection, which the socket monitor reports. A vanished
# remote host is found by TCP keepalive, not ZMQ heartbeats: under backpressure those trip a
# libzmq assertion that aborts the client process.
TCP_KEEPALIVE_IDLE_S = 10
TCP_KEEPALIVE_INTERVAL_S = 2
TCP_KEEPALIVE_COUNT = 5


def connect_to_engine(sock: zmq.Socket, address: str, curve: CurveKeys | None) -> None:
    """Set the options every client connection has (linger, CURVE, keepalive), then connect."""
    sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    if curve is not None:  # a CURVE client: the client keypair and the engine's public key
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key.encode())
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_COUNT)
    sock.connect(address)
