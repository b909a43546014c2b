"""The gloo interface choice: only across hosts, never over the user's own choice."""

from deploy.network import GLOO_SOCKET_IFNAME, choose_gloo_interface


def test_a_single_rank_or_a_loopback_rendezvous_leaves_gloo_alone() -> None:
    environ: dict[str, str] = {}
    assert choose_gloo_interface("10.1.2.3", 1, environ) is None  # one rank forms no group
    assert choose_gloo_interface("127.0.0.1", 2, environ) is None  # every rank on this host
    assert environ == {}


def test_the_users_own_interface_is_kept() -> None:
    environ = {GLOO_SOCKET_IFNAME: "ib0"}
    assert choose_gloo_interface("10.1.2.3", 2, environ) is None
    assert environ == {GLOO_SOCKET_IFNAME: "ib0"}


def test_an_unresolvable_rendezvous_host_changes_nothing() -> None:
    environ: dict[str, str] = {}
    assert choose_gloo_interface("no-such-host.invalid", 2, environ) is None
    assert environ == {}
