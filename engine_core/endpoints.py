"""Endpoints: binding the engine's sockets so that a second deployment never steals the first's
addresses, a busy address is one clear error naming its flag, and at exit only the ipc:// socket
files this engine created are removed. No policy beyond that.
"""

import contextlib
import errno
import logging
import os
import socket

import zmq

logger = logging.getLogger(__name__)

IPC_PREFIX = "ipc://"
TCP_PREFIX = "tcp://"
PROBE_TIMEOUT_S = 0.5  # a live ipc socket accepts at once; a stale file refuses at once


class AddressInUseError(RuntimeError):
    """An address the engine must bind is taken or unusable; a usage error (exit 2)."""


def ipc_path(address: str) -> str | None:
    """The file of an ipc:// address, or None for another transport or an abstract socket."""
    if not address.startswith(IPC_PREFIX):
        return None
    path = address.removeprefix(IPC_PREFIX)
    return None if path.startswith("@") else path  # @: Linux's abstract namespace, no file


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


class Endpoints:
    """The addresses this engine bound.

    Invariants: `owned_files` maps each ipc socket file this engine created to the (device,
    inode) it had right after the bind, so a file another engine made later is never removed.
    """

    def __init__(self) -> None:
        self.owned_files: dict[str, tuple[int, int]] = {}

    def bind(self, sock: zmq.Socket, address: str, flag: str) -> None:
        """Bind `sock` after checking nobody serves there; AddressInUseError names the flag."""
        check_free(address, flag)
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
