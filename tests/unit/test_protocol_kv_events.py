"""KV events on the wire: round trips through the kv-events decoder, and malformed frames."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import kv_event_decoder, make_encoder
from protocol.errors import ProtocolError
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

HASHES = st.lists(st.binary(min_size=16, max_size=32), max_size=4)
EVENTS = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=HASHES,
        parent_block_hash=st.none() | st.binary(min_size=16, max_size=32),
        token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=32),
        block_size=st.integers(1, 256),
        group_idx=st.integers(0, 7),
    ),
    st.builds(BlockRemoved, block_hashes=HASHES, group_idx=st.integers(0, 7)),
    st.just(AllBlocksCleared()),
)


@given(ts=st.floats(allow_nan=False, allow_infinity=False), events=st.lists(EVENTS, max_size=5))
def test_event_batches_round_trip(ts: float, events: list) -> None:
    batch = KVEventBatch(ts=ts, events=events)
    assert kv_event_decoder().decode(make_encoder().encode(batch)) == batch


def test_events_are_tagged_arrays_on_the_wire() -> None:
    event = BlockRemoved(block_hashes=[b"\x01" * 16])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event)) == [
        "BlockRemoved",
        [b"\x01" * 16],
        0,
    ]


def test_block_removed_defaults_to_group_zero() -> None:
    assert BlockRemoved(block_hashes=[]).group_idx == 0


@pytest.mark.parametrize(
    "frame",
    [b"\xff\x00", msgspec.msgpack.encode([1.0, [["NoSuchEvent"]]]), msgspec.msgpack.encode("x")],
)
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed frame on the kv-events socket"):
        kv_event_decoder().decode(frame)
