"""Which ports `free_tcp_ports` draws from: outside the kernel's ephemeral range, so that no bind
to port 0 and no outgoing connection takes one before its user binds it. No sockets here."""

import random

import pytest

from engine_core.net import endpoints
from engine_core.net.endpoints import HIGHEST_PORT, LOWEST_CHOSEN_PORT, _bind_probe, choosable_ports


@pytest.mark.parametrize(
    ("ephemeral_range", "expected"),
    [
        ("32768\t60999\n", range(LOWEST_CHOSEN_PORT, 32768)),  # Linux's default
        ("40000 65535", range(LOWEST_CHOSEN_PORT, 40000)),
        ("1024 50000", range(50001, HIGHEST_PORT + 1)),  # only the gap above is wide enough
        ("5000 20000", range(20001, HIGHEST_PORT + 1)),  # never below LOWEST_CHOSEN_PORT
    ],
)
def test_the_wider_gap_beside_the_ephemeral_range_is_drawn_from(
    ephemeral_range: str, expected: range
) -> None:
    assert choosable_ports(ephemeral_range) == expected


@pytest.mark.parametrize(
    "ephemeral_range",
    [None, "", "32768", "32768 60999 1", "low high", "1024 65000", "10500 65000"],
)
def test_an_unknown_or_crowded_range_leaves_the_choice_to_the_kernel(
    ephemeral_range: str | None,
) -> None:
    assert choosable_ports(ephemeral_range) is None


class FakeProbe:
    """A socket stand-in whose bind fails for the ports in `taken`."""

    def __init__(self, taken: set[int]) -> None:
        self.taken = taken
        self.tried: list[int] = []
        self.bound: tuple[str, int] | None = None

    def bind(self, address: tuple[str, int]) -> None:
        self.tried.append(address[1])
        if address[1] in self.taken:
            raise OSError(98, "Address already in use")
        self.bound = address


def test_a_probe_binds_the_first_free_drawn_port() -> None:
    candidates = range(20000, 21000)
    probe = FakeProbe(taken=set(range(20000, 20500)))  # all 64 draws taken: odds 2**-64
    _bind_probe(probe, "127.0.0.1", candidates)  # type: ignore[arg-type]
    assert probe.bound is not None and probe.bound[1] in range(20500, 21000)
    assert all(port in candidates for port in probe.tried)
    assert len(set(probe.tried)) == len(probe.tried) <= endpoints.PORT_DRAWS


def test_a_probe_asks_the_kernel_when_every_drawn_port_is_taken() -> None:
    candidates = range(20000, 21000)
    probe = FakeProbe(taken=set(candidates))
    _bind_probe(probe, "127.0.0.1", candidates)  # type: ignore[arg-type]
    assert len(probe.tried) == endpoints.PORT_DRAWS + 1
    assert probe.bound == ("127.0.0.1", 0)


def test_without_candidates_the_kernel_picks_at_once() -> None:
    probe = FakeProbe(taken=set())
    _bind_probe(probe, "127.0.0.1", None)  # type: ignore[arg-type]
    assert probe.tried == [0] and probe.bound == ("127.0.0.1", 0)


def test_draws_ignore_the_random_modules_seed() -> None:
    """Two processes that seed `random` alike (benches, tests) must not draw the same ports."""
    draws, state = [], random.getstate()
    try:
        for _ in range(2):
            random.seed(1234)
            probe = FakeProbe(taken=set(range(20000, 21000)))
            _bind_probe(probe, "127.0.0.1", range(20000, 21000))  # type: ignore[arg-type]
            draws.append(probe.tried)
    finally:
        random.setstate(state)  # the seed stays this test's
    assert draws[0] != draws[1]  # equal by chance: odds below 1000**-64
