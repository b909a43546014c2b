"""KV events on the wire: vLLM 0.33's exact bytes, round trips through the kv-events decoder, and
malformed frames.
"""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import kv_event_decoder, make_encoder
from protocol.errors import ProtocolError
from protocol.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    block_removed,
    block_stored,
)

HASHES = st.lists(st.binary(min_size=16, max_size=32), max_size=4)
EVENTS = st.one_of(
    st.builds(
        block_stored,
        block_hashes=HASHES,
        parent_block_hash=st.none() | st.binary(min_size=16, max_size=32),
        token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=32),
        block_size=st.integers(1, 256),
        group_idx=st.integers(0, 7),
    ),
    st.builds(block_removed, block_hashes=HASHES, group_idx=st.integers(0, 7)),
    st.just(AllBlocksCleared()),
)
# What vLLM 0.33.0's msgspec encoder writes for KVEventBatch(ts=1.0, events=[BlockStored(
# block_hashes=[b"a" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
# medium="GPU", lora_name=None, group_idx=0), BlockRemoved(block_hashes=[b"b"], medium="GPU",
# group_idx=0), AllBlocksCleared()], data_parallel_rank=0), captured in the peer environment.
VLLM_BATCH_BYTES = (
    b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x93\xde\x00\t\xa4type\xabBlockStored\xacblock_hashes"
    b"\x91\xc4 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\xb1parent_block_hash\xc0\xa9token_ids\x92\x01\x02"
    b"\xaablock_size\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xa9group_idx\x00\x84"
    b"\xa4type\xacBlockRemoved\xacblock_hashes\x91\xc4\x01b\xa6medium\xa3GPU\xa9group_idx\x00\x81"
    b"\xa4type\xb0AllBlocksCleared\x00"
)


@given(
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(EVENTS, max_size=5),
    rank=st.none() | st.integers(0, 7),
)
def test_event_batches_round_trip(ts: float, events: list, rank: int | None) -> None:
    batch = KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)
    assert kv_event_decoder().decode(make_encoder().encode(batch)) == batch


def test_a_batch_encodes_to_the_bytes_vllm_writes() -> None:
    batch = KVEventBatch(
        ts=1.0,
        events=[
            block_stored([b"a" * 32], None, [1, 2], 2, 0),
            block_removed([b"b"], 0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert make_encoder().encode(batch) == VLLM_BATCH_BYTES
    assert kv_event_decoder().decode(VLLM_BATCH_BYTES) == batch


def test_events_are_maps_tagged_by_type_with_vllms_field_names() -> None:
    event = block_removed([b"\x01" * 16], 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event)) == {
        "type": "BlockRemoved",
        "block_hashes": [b"\x01" * 16],
        "medium": "GPU",
        "group_idx": 3,
    }


def test_a_batch_without_a_data_parallel_rank_decodes() -> None:
    frame = msgspec.msgpack.encode([2.5, [{"type": "AllBlocksCleared"}]])
    assert kv_event_decoder().decode(frame) == KVEventBatch(2.5, [AllBlocksCleared()])


def test_block_stored_always_carries_the_fields_vllm_requires() -> None:
    encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(block_stored([], None, [], 4, 2)))
    assert list(encoded) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
    ]


def test_a_frame_with_vllms_optional_fields_and_unknown_ones_decodes() -> None:
    stored = {"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None}
    stored |= {"token_ids": [7], "block_size": 1, "lora_id": None, "medium": "GPU"}
    stored |= {"lora_name": None, "group_idx": 1, "session_id": "s", "future_field": 3}
    batch = kv_event_decoder().decode(msgspec.msgpack.encode([0.0, [stored], 0]))
    expected = BlockStored([b"h"], None, [7], 1, None, "GPU", None, group_idx=1, session_id="s")
    assert batch.events == [expected]


@pytest.mark.parametrize(
    "frame",
    [
        b"\xff\x00",
        msgspec.msgpack.encode([1.0, [{"type": "NoSuchEvent"}]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [b"h"], "GPU", 0]]]),  # the old arrays
        msgspec.msgpack.encode("x"),
    ],
)
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed frame on the kv-events socket"):
        kv_event_decoder().decode(frame)
