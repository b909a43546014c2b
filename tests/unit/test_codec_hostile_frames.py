"""Any frame a client can send is at worst rejected with a reason: deep nesting, garbage and
truncation raise ProtocolError from the typed decoder, and the fallback that reads a malformed
frame's req_id or call_id never raises at all."""

import contextlib
import random

import msgspec
import pytest

from engine_core.service.client_router import frame_ids_decoder, readable_ids
from protocol.codec import (
    client_to_engine_decoder,
    engine_to_client_decoder,
    engine_to_worker_decoder,
    worker_to_engine_decoder,
)
from protocol.errors import ProtocolError

NESTED = [
    b"\x91" * 1000 + b"\x00",  # 1,000 nested arrays: the 1 KB frame that killed the engine
    b"\x81\x00" * 1000 + b"\x00",  # nested maps
    b"\x91" * 200_000 + b"\x00",
    b"\x81\xa6req_id" + b"\x91" * 5000 + b"\x00",  # a field whose value nests deep
    b"\x82\xa4type\xadAbortRequests\xa7req_ids" + b"\x91" * 5000 + b"\xa1x",
]


@pytest.mark.parametrize("frame", NESTED, ids=lambda frame: f"{len(frame)}-bytes")
@pytest.mark.parametrize(
    "make_decoder",
    [
        client_to_engine_decoder,
        engine_to_client_decoder,
        engine_to_worker_decoder,
        worker_to_engine_decoder,
    ],
)
def test_deeply_nested_frames_are_a_protocol_error(frame: bytes, make_decoder: object) -> None:
    """Guards against the RecursionError that escaped every handler and killed the engine."""
    with pytest.raises(ProtocolError, match="malformed frame"):
        make_decoder().decode(frame)  # type: ignore[operator]


@pytest.mark.parametrize("frame", NESTED, ids=lambda frame: f"{len(frame)}-bytes")
def test_the_fallback_id_reader_never_raises_on_nested_frames(frame: bytes) -> None:
    assert readable_ids(frame_ids_decoder(), frame) == (None, None)


def test_the_fallback_id_reader_finds_the_ids_of_a_malformed_request() -> None:
    decoder = frame_ids_decoder()
    frame = msgspec.msgpack.encode({"type": "Nope", "req_id": "r-1", "junk": [[[1]]]})
    assert readable_ids(decoder, frame) == ("r-1", None)
    frame = msgspec.msgpack.encode({"call_id": 7, "method": 3})
    assert readable_ids(decoder, frame) == (None, 7)
    assert readable_ids(decoder, msgspec.msgpack.encode({"req_id": 5})) == (None, None)


def test_random_bytes_never_escape_as_anything_but_protocol_error() -> None:
    rng = random.Random(0)
    decoder, ids = client_to_engine_decoder(), frame_ids_decoder()
    valid = msgspec.msgpack.encode({"type": "AbortRequests", "req_ids": ["a", "b"]})
    for _ in range(5000):
        frame = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        frame = bytes(frame[: rng.randrange(1, len(frame) + 1)])
        with contextlib.suppress(ProtocolError):  # the only way a frame may fail
            decoder.decode(frame)
        readable_ids(ids, frame)
