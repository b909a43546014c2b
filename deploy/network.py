"""Which network interface a worker's gloo group uses. Gloo binds the address its host name
resolves to, which on many hosts (Debian's 127.0.1.1 entry, a container without DNS) is loopback:
across hosts the ranks then cannot reach each other. This picks the interface that routes to the
rendezvous host instead, as GLOO_SOCKET_IFNAME would, unless the user set that variable.
"""

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address
PROBE_PORT = 9  # any port: a connected UDP socket sends nothing, it only picks a route


def local_address_towards(host: str) -> str | None:
    """The local IPv4 address the kernel would use to reach `host`, or None when unresolvable."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, PROBE_PORT))
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the interface that holds IPv4 `address`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def choose_gloo_interface(
    master_addr: str, tp_size: int, environ: MutableMapping[str, str]
) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface towards `master_addr` when ranks may sit on other
    hosts and the user chose none; the interface set, or None when nothing was changed."""
    if tp_size == 1 or GLOO_SOCKET_IFNAME in environ:
        return None
    local = local_address_towards(master_addr)
    if local is None or ipaddress.ip_address(local).is_loopback:
        return None  # one host: gloo's default works there
    name = interface_with_address(local)
    if name is not None:
        environ[GLOO_SOCKET_IFNAME] = name
        logger.info("gloo uses interface %s (%s), the route to %s", name, local, master_addr)
    return name
