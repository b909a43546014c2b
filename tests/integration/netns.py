"""Network namespaces that stand in for hosts: each "host" gets a namespace with `lo` and one
veth into a bridge in a hub namespace, on a private subnet that exists only inside them. Nothing
is added to the namespace the tests run in, and close() removes everything, even after a failure.
"""

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.integration.conftest import ROOT, Processes

IP_TIMEOUT_S = 10.0  # one `ip` command
HOST_DEVICE = "eth0"  # every host's end of its veth; names are per namespace
BRIDGE = "br0"
SUBNET_PREFIX_LEN = 24
_runs = itertools.count()  # namespaces of one pytest process get a fresh suffix per fixture


def ip(*args: str) -> None:
    """Run `ip ARGS`; RuntimeError with ip's own words when it fails."""
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        command = " ".join(args)
        raise RuntimeError(f"ip {command} exited {result.returncode}: {result.stderr.strip()}")


def why_namespaces_cannot_be_made() -> str | None:
    """None when this process can make network namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"network namespaces need `{tool}` ({package}), which is not installed"
    probe = f"kvs{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace: {exc}"
    ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge: its name, its hostname, its device and its address on the
    subnet."""

    namespace: str
    hostname: str
    device: str
    address: str


class NetworkNamespaces:
    """A bridge in a hub namespace and hosts added to it, each a namespace with one veth.

    Invariants: every namespace and veth in `_namespaces` was made by this object and is removed
    by close(); host addresses are distinct within 10.X.Y.0/24, which no other namespace sees.
    """

    def __init__(self) -> None:
        pid = os.getpid()
        self.prefix = f"kvs{pid}-{next(_runs)}"  # unique per run; `ip netns list` shows whose
        self.subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"  # unusual, and private anyway
        self.hub = f"{self.prefix}-hub"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []

    def add_hub(self) -> None:
        """The hub namespace and its bridge; first, before any host."""
        self._add_namespace("hub")
        ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.hub, "link", "set", BRIDGE, "up")

    def _add_namespace(self, name: str) -> str:
        namespace = f"{self.prefix}-{name}"
        ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        ip("-n", namespace, "link", "set", "lo", "up")  # a host's own loopback works
        return namespace

    def add_host(self, name: str) -> Host:
        """A namespace `name` joined to the bridge, with the next address of the subnet."""
        namespace = self._add_namespace(name)
        port = f"v-{name}"[:15]  # the hub's end of the veth; Linux names hold 15 bytes
        peer = ("peer", "name", HOST_DEVICE, "netns", namespace)
        ip("-n", self.hub, "link", "add", port, "type", "veth", *peer)
        ip("-n", self.hub, "link", "set", port, "master", BRIDGE)
        ip("-n", self.hub, "link", "set", port, "up")
        address = f"{self.subnet}.{len(self.hosts) + 1}"
        ip("-n", namespace, "addr", "add", f"{address}/{SUBNET_PREFIX_LEN}", "dev", HOST_DEVICE)
        ip("-n", namespace, "link", "set", HOST_DEVICE, "up")
        host = Host(namespace, namespace, HOST_DEVICE, address)
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """Take the host's link down: its peers hear nothing more from it, nor it from them."""
        host = self.hosts[name]
        ip("-n", host.namespace, "link", "set", host.device, "down")

    def mend(self, name: str) -> None:
        """Bring the host's link back up; its address and route come back with it."""
        host = self.hosts[name]
        ip("-n", host.namespace, "link", "set", host.device, "up")

    def close(self) -> None:
        """Delete every namespace made here (their veths go with them), the hub last."""
        errors = []
        for namespace in reversed(self._namespaces):
            try:
                ip("netns", "del", namespace)
            except RuntimeError as exc:
                errors.append(str(exc))
        self._namespaces.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


def start_in(
    processes: Processes, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Run `argv` on `host` as process `name`, logging to tmp_path/<name>.log: in its network
    namespace and under its own hostname, which a kvserve engine compares with its own to tell
    a local rank (watched through its pid) from a remote one (watched through heartbeats).

    `ip netns exec`, `unshare` and `sh` each exec the next, so the pid is the command's own.
    """
    log = open(processes.tmp_path / f"{name}.log", "wb")  # noqa: SIM115  # closed with the process
    on_host = ["ip", "netns", "exec", host.namespace, "unshare", "--uts"]
    on_host += ["sh", "-c", 'hostname "$0" && exec "$@"', host.hostname]
    proc = subprocess.Popen(
        [*on_host, *argv],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    processes.procs[name] = proc
    return proc


def console_script(script: str) -> str:
    """The path of an installed console script (kvserve, kvserve-core, ...) of this venv."""
    path = Path(sys.executable).parent / script
    assert path.exists(), f"{script} is not installed next to {sys.executable}: pip install -e ."
    return str(path)
