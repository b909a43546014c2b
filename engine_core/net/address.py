"""What an address names: its transport (ipc://, tcp://), the file behind an ipc:// address,
whether a tcp address stays on this host, and AddressInUseError, the usage error of an address the
engine cannot serve on. Pure functions of the text: it never opens a socket.
"""

import ipaddress

IPC_PREFIX = "ipc://"
TCP_PREFIX = "tcp://"
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


class AddressInUseError(RuntimeError):
    """An address the engine must bind is taken or unusable; a usage error (exit 2)."""


def ipc_path(address: str) -> str | None:
    """The file of an ipc:// address, or None for another transport or an abstract socket."""
    if not address.startswith(IPC_PREFIX):
        return None
    path = address.removeprefix(IPC_PREFIX)
    return None if path.startswith("@") else path  # @: Linux's abstract namespace, no file


def is_loopback(address: str) -> bool:
    """True for ipc://, inproc:// and tcp on 127.0.0.0/8, ::1 or localhost; False for any other
    tcp host (a wildcard, an interface, a name), which other hosts may reach."""
    if not address.startswith(TCP_PREFIX):
        return True  # ipc:// and inproc:// never leave this host
    host = address.removeprefix(TCP_PREFIX).rpartition(":")[0].strip("[]")
    host = host.rpartition(";")[2]  # tcp://source;host:port binds nothing at the source
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
