"""Endpoints: binding the engine's sockets so that a second deployment never steals the first's
addresses, a busy address is one clear error naming its flag, each socket is a CURVE server when
keys are configured, ipc:// files are the owner's alone, and at exit only the socket files this
engine created are removed.
"""

import contextlib
import errno
import logging
import os
import random
import socket

import zmq

from engine_core.net.address import TCP_PREFIX, AddressInUseError, ipc_path
from engine_core.net.curve import make_curve_server
from protocol.config import CurveKeys

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5  # a live ipc socket accepts at once; a stale file refuses at once
IPC_FOLDER_MODE = 0o700  # a folder the engine makes for its ipc sockets
IPC_FILE_MODE = 0o600  # an ipc socket file: only the owner may connect
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"  # "low high", Linux
LOWEST_CHOSEN_PORT = 10000  # well-known services crowd the ports below
HIGHEST_PORT = 65535
MIN_CHOSEN_PORTS = 1000  # a narrower gap beside the ephemeral range is left alone
PORT_DRAWS = 64  # ports drawn per probe before the kernel is asked for one
# Drawn from the OS, not the `random` module: processes seeded alike must not draw alike.
_port_draws = random.SystemRandom()


def check_free(address: str, flag: str) -> None:
    """Raise AddressInUseError when something live already serves at `address`."""
    path = ipc_path(address)
    if path is not None:
        _check_ipc_free(path, address, flag)
    elif address.startswith(TCP_PREFIX):
        _check_tcp_free(address, flag)


def _check_ipc_free(path: str, address: str, flag: str) -> None:
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # a file left by a process that died: binding replaces it
        except OSError as exc:
            raise AddressInUseError(f"{flag} {address} is unusable: {exc.strerror}") from None
    raise AddressInUseError(
        f"{flag} {address} is in use: another process serves on it (stop it, or pick another path)"
    )


def _check_tcp_free(address: str, flag: str) -> None:
    host, _, port_text = address.removeprefix(TCP_PREFIX).rpartition(":")
    if not port_text.isdigit() or int(port_text) == 0:
        return  # a wildcard port: the bind picks a free one
    host = host.strip("[]")
    host = "0.0.0.0" if host in ("*", "") else host
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, int(port_text), type=socket.SOCK_STREAM
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        reason = f"has a host that does not resolve: {exc}"
        raise AddressInUseError(f"{flag} {address} {reason}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            is_in_use = exc.errno == errno.EADDRINUSE
            reason = "is in use" if is_in_use else f"is unusable: {exc.strerror}"
            raise AddressInUseError(f"{flag} {address} {reason}") from None


def prepare_ipc_folder(address: str) -> None:
    """Make the folder of an ipc:// socket file, owner-only, when it does not exist yet; a folder
    that exists is the operator's and is left as it is."""
    path = ipc_path(address)
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        os.makedirs(folder, mode=IPC_FOLDER_MODE, exist_ok=True)
        os.chmod(folder, IPC_FOLDER_MODE)  # makedirs' mode is masked by the umask


def free_tcp_ports(num_ports: int, host: str = "127.0.0.1") -> list[int]:
    """`num_ports` distinct free tcp ports on `host`: each probe socket stays bound until all are
    chosen, so that no port comes out twice. They come from outside the kernel's ephemeral range
    when it leaves room there: a bind to port 0 or an outgoing connection, in any process, then
    cannot take one before its user binds it (only a process binding that very port could)."""
    candidates = choosable_ports(_read_ephemeral_range())
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(num_ports):
            probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            _bind_probe(probe, host, candidates)
            ports.append(probe.getsockname()[1])
        return ports


def choosable_ports(ephemeral_range: str | None) -> range | None:
    """The ports `free_tcp_ports` draws from: the wider gap between LOWEST_CHOSEN_PORT and the
    ephemeral range (the text of EPHEMERAL_RANGE_FILE) or above it, or None when the range is
    unknown or neither gap holds MIN_CHOSEN_PORTS ports."""
    if ephemeral_range is None:
        return None
    try:
        low, high = (int(field) for field in ephemeral_range.split())
    except ValueError:
        return None
    below = range(LOWEST_CHOSEN_PORT, low)
    above = range(max(high + 1, LOWEST_CHOSEN_PORT), HIGHEST_PORT + 1)
    widest = max(below, above, key=len)
    return widest if len(widest) >= MIN_CHOSEN_PORTS else None


def _read_ephemeral_range() -> str | None:
    try:
        with open(EPHEMERAL_RANGE_FILE, encoding="ascii") as file:
            return file.read()
    except OSError:  # not Linux, or no /proc: the kernel's own choice will do
        return None


def _bind_probe(probe: socket.socket, host: str, candidates: range | None) -> None:
    """Bind `probe` to a free port drawn from `candidates`, else to one the kernel picks."""
    if candidates is not None:
        for port in _port_draws.sample(candidates, PORT_DRAWS):
            try:
                probe.bind((host, port))
                return
            except OSError:  # taken, or lingering in TIME_WAIT: draw another
                continue
    probe.bind((host, 0))


class Endpoints:
    """The addresses this engine bound.

    Invariants: `owned_files` maps each ipc socket file this engine created to the (device,
    inode) it had right after the bind, so a file another engine made later is never removed;
    each of those files has mode IPC_FILE_MODE.
    """

    def __init__(self, curve: CurveKeys | None = None) -> None:
        self.owned_files: dict[str, tuple[int, int]] = {}
        self.curve = curve  # every socket bound here is a CURVE server when set

    def bind(self, sock: zmq.Socket, address: str, flag: str) -> None:
        """Bind `sock` after checking nobody serves there; AddressInUseError names the flag."""
        check_free(address, flag)
        make_curve_server(sock, self.curve, flag)
        prepare_ipc_folder(address)
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            raise AddressInUseError(f"cannot bind {flag} {address}: {exc.strerror}") from None
        self.adopt(address)

    def adopt(self, address: str) -> None:
        """Record the ipc file of an address just bound (by this object or by another part of
        this engine), so that exit removes it."""
        path = ipc_path(address)
        if path is not None:
            os.chmod(path, IPC_FILE_MODE)
            stat = os.stat(path)
            self.owned_files[path] = (stat.st_dev, stat.st_ino)

    def remove_files(self) -> None:
        """libzmq leaves a bound ipc socket's file behind: remove those this engine created."""
        for path, identity in self.owned_files.items():
            with contextlib.suppress(FileNotFoundError):
                stat = os.stat(path)
                if (stat.st_dev, stat.st_ino) == identity:
                    os.unlink(path)
                else:
                    logger.info("left %s alone: another process bound it since", path)
        self.owned_files.clear()
