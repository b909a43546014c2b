"""CURVE on the engine's sockets: the rule that a non-loopback tcp address needs keys, the ZAP
handler that admits only authorized public keys (and logs every refusal with the peer's address),
and the options that make a socket a CURVE server. It reads no files: keys come in the config.
"""

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine_core.net.address import AddressInUseError, is_loopback
from protocol.config import CurveKeys, EngineConfig

logger = logging.getLogger(__name__)

AUTH_STOP_TIMEOUT_S = 2.0  # the ZAP thread answers TERMINATE at once; never wait longer
KEYGEN_HINT = "make keys with `kvserve keygen DIR`, then pass --curve-keys-dir DIR"
# Each socket's ZAP domain is the flag that sets its address, so a refusal names the socket.
SOCKET_DOMAINS = ("--worker-address", "--client-address", "--kv-events-config")


class InsecureAddressError(AddressInUseError):
    """A non-loopback tcp address without CURVE keys and without --insecure: a usage error."""


def bound_addresses(config: EngineConfig) -> list[tuple[str, str]]:
    """(flag, address) of every ZMQ socket the engine binds."""
    addresses = [
        ("--client-address", config.client_address),
        ("--worker-address", config.worker_address),
    ]
    kv_events = config.kv_events
    if kv_events.enable_kv_cache_events:
        for address in filter(None, [kv_events.endpoint, kv_events.replay_endpoint]):
            addresses.append(("--kv-events-config", address))
    transfer = config.kv_transfer_address
    if config.kv_role == "prefill" and transfer is not None and transfer.startswith("tcp://"):
        addresses.append(("--kv-transfer-address", f"{transfer}:0"))  # its ranks bind a port
    return addresses


def check_secure(config: EngineConfig) -> None:
    """Raise InsecureAddressError for the first non-loopback tcp address bound without keys."""
    if config.curve is not None or config.allow_insecure:
        return
    for flag, address in bound_addresses(config):
        if not is_loopback(address):
            raise InsecureAddressError(
                f"{flag} {address} is reachable from other hosts and has no CURVE keys: "
                f"{KEYGEN_HINT} (or pass --insecure to serve it unauthenticated)"
            )


class ZapGuard(ThreadAuthenticator):
    """The ZAP handler of one engine context: admits a CURVE client only when its public key is
    among `authorized_keys`, and logs each refusal at WARNING with the peer's address.

    Invariants: `_authorized` never changes after start; `_peer_address` is that of the ZAP
    request being answered (one thread answers them, one at a time).
    """

    def __init__(self, ctx: zmq.Context, authorized_keys: list[str]) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._authorized = frozenset(key.encode() for key in authorized_keys)
        self._peer_address = ""
        self._peer_domain = ""
        # A refused peer reconnects every ZMQ_RECONNECT_IVL: its refusals are logged the 1st,
        # 2nd, 4th, 8th... time, so a rogue cannot flood the log.
        self._num_refusals: dict[tuple[str, str], int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        """The credentials provider pyzmq asks, with the client's Z85 public key."""
        return key in self._authorized

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 4:
            self._peer_domain = msg[2].decode(errors="replace")
            self._peer_address = msg[3].decode(errors="replace")
        await super().handle_zap_message(msg)

    def _send_zap_reply(
        self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = "anonymous"
    ) -> None:
        if status_code != b"200":
            peer = (self._peer_address or "an unknown address", self._peer_domain or "the engine")
            count = self._num_refusals[peer] = self._num_refusals.get(peer, 0) + 1
            if count & (count - 1) == 0:
                logger.warning(
                    "refused a peer at %s on %s: %s (%d times so far)",
                    *peer,
                    status_text.decode(errors="replace"),
                    count,
                )
        super()._send_zap_reply(request_id, status_code, status_text, user_id)

    def stop(self) -> None:
        """Stop the ZAP thread within AUTH_STOP_TIMEOUT_S (pyzmq's own stop waits unbounded)."""
        if self.pipe is None:
            return
        self.pipe.send(b"TERMINATE")
        if self.thread is not None:
            self.thread.join(AUTH_STOP_TIMEOUT_S)
            if self.thread.is_alive():
                logger.warning("the ZAP thread did not stop in %.1f s", AUTH_STOP_TIMEOUT_S)
        self.thread = None  # type: ignore[assignment]
        self.pipe.close(linger=0)
        self.pipe = None  # type: ignore[assignment]
        if self.zap_socket is not None:
            self.zap_socket.close(linger=0)
            self.zap_socket = None  # type: ignore[assignment]


def make_curve_server(sock: zmq.Socket, curve: CurveKeys | None, flag: str) -> None:
    """Make `sock` a CURVE server before it binds (without keys: leave it as is). Its ZAP domain
    is `flag`, so the ZAP handler's refusals name the socket."""
    if curve is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, flag.encode())


def start_zap_guard(ctx: zmq.Context, config: EngineConfig) -> ZapGuard | None:
    """Refuse an insecure configuration, then start the ZAP handler on `ctx` before any bind
    (a CURVE socket bound without one admits every key); None without keys."""
    check_secure(config)
    if config.curve is None:
        return None
    guard = ZapGuard(ctx, config.curve.authorized_keys)
    guard.start()
    for domain in ("*", *SOCKET_DOMAINS):
        guard.configure_curve_callback(domain=domain, credentials_provider=guard)
    logger.info("CURVE on: %d authorized public keys", len(config.curve.authorized_keys))
    return guard
