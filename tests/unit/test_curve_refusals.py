"""CurveRefusals turns a socket monitor's events into one log line per refused peer, with
its address, and tells the rank watch which disconnects were refusals, not lost ranks."""

import logging

import pytest
import zmq

from engine_core.net.curve_refusals import CurveRefusals, peer_address


def _event(kind: int, value: int) -> dict:
    return {"event": kind, "value": value, "endpoint": b"tcp://127.0.0.1:5555"}


def _refuse(refusals: CurveRefusals, fd: int) -> bool:
    refusals.on_event(_event(zmq.EVENT_ACCEPTED, fd))
    refusals.on_event(
        _event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    )
    return refusals.on_event(_event(zmq.EVENT_DISCONNECTED, fd))


def test_a_keyless_peer_is_logged_with_the_flag_and_its_disconnect_marked_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = CurveRefusals("--worker-address")
    with caplog.at_level(logging.WARNING):
        assert _refuse(refusals, -1) is True  # fd -1: the address cannot be read
    (record,) = caplog.records
    assert record.getMessage() == (
        "refused a peer at an address that closed before it could be read on --worker-address: "
        "no CURVE handshake "
        "(a peer without keys, or another security mechanism) (1 times so far)"
    )
    refusals.check_invariants()


def test_a_peer_that_completed_its_handshake_disconnects_unlogged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = CurveRefusals("--client-address")
    with caplog.at_level(logging.WARNING):
        refusals.on_event(_event(zmq.EVENT_ACCEPTED, -1))
        assert refusals.on_event(_event(zmq.EVENT_DISCONNECTED, -1)) is False
    assert not caplog.records


def test_a_retrying_peer_is_logged_at_powers_of_two(caplog: pytest.LogCaptureFixture) -> None:
    refusals = CurveRefusals("--client-address")
    with caplog.at_level(logging.WARNING):
        marked = [_refuse(refusals, -1) for _ in range(9)]
    assert marked == [True] * 9  # every disconnect is a refusal, logged or not
    counts = [record.getMessage().rsplit("(", 1)[1] for record in caplog.records]
    assert counts == ["1 times so far)", "2 times so far)", "4 times so far)", "8 times so far)"]


def test_an_unreadable_connection_has_an_unknown_peer() -> None:
    """The connection may be gone by the time its ACCEPTED event is read; the tcp case, with the
    peer's host:port, is checked against real keyless peers in tests/integration/test_curve.py."""
    assert peer_address(-1) == "an address that closed before it could be read"
