"""The reply lanes of the shared-memory ring, in one process: each reader's replies reach the writer
once and in order, lane by lane; a full lane blocks its reader until the writer takes a reply or
the deadline passes, never overwriting; a reply written while the writer sleeps wakes it.
"""

import random
import select
import threading
from collections.abc import Iterator

import pytest

from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol.shm_ring import ReplyTooLargeError, RingClosedError, RingLayout
from worker.shm_ring_reader import ShmRingReader

NUM_REPLY_SLOTS = 3
REPLY_SLOT_BYTES = 128  # 120 bytes of reply after the size word
WAIT_S = 30.0  # generous: a blocking test must end by a wake-up, never by this deadline
SHORT_S = 0.05  # for the waits that are meant to time out


@pytest.fixture
def writer() -> Iterator[ShmRingWriter]:
    ring = ShmRingWriter(
        2, num_slots=4, slot_bytes=64, num_reply_slots=NUM_REPLY_SLOTS, reply_slot_bytes=128
    )
    yield ring
    ring.close()


def test_lanes_follow_the_step_slots_one_per_reader() -> None:
    layout = RingLayout(2, 4, 64, NUM_REPLY_SLOTS, REPLY_SLOT_BYTES)
    lane_bytes = 2 * 64 + NUM_REPLY_SLOTS * REPLY_SLOT_BYTES
    assert layout.size_bytes == RingLayout(2, 4, 64).size_bytes + 2 * lane_bytes
    assert layout.lane_offset(1) == layout.lane_offset(0) + lane_bytes
    assert layout.reply_slot_offset(1, NUM_REPLY_SLOTS) == layout.reply_slot_offset(1, 0)
    with pytest.raises(ValueError, match="reply_slot_bytes=100"):
        RingLayout(2, 4, 64, NUM_REPLY_SLOTS, 100)


def test_replies_arrive_in_order_lane_by_lane_through_wrap_around(writer: ShmRingWriter) -> None:
    rng = random.Random(3)
    readers = [ShmRingReader(writer.name, idx) for idx in range(2)]
    sent: list[list[bytes]] = [[], []]
    for _ in range(5 * NUM_REPLY_SLOTS):
        for idx in rng.sample(range(2), 2):
            reply = rng.randbytes(rng.choice([0, 1, 119, 120, rng.randrange(121)]))
            readers[idx].write_reply(reply, WAIT_S)
            sent[idx].append(reply)
        for idx in range(2):
            assert writer.read_reply(idx) == sent[idx][-1]
        assert writer.read_reply(0) is None and writer.read_reply(1) is None
    for reader in readers:
        reader.close()


def test_a_reply_larger_than_a_slot_is_refused(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 0) as reader:
        with pytest.raises(ReplyTooLargeError, match="121 bytes does not fit"):
            reader.write_reply(bytes(121), WAIT_S)
        assert writer.read_reply(0) is None


def test_a_full_lane_waits_for_the_writer_and_never_overwrites(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 1) as reader:
        replies = [bytes([i]) * 10 for i in range(NUM_REPLY_SLOTS)]
        for reply in replies:
            reader.write_reply(reply, WAIT_S)
        with pytest.raises(TimeoutError, match=r"reader 1 of ring .* took none of its last 3"):
            reader.write_reply(b"overwrite?", SHORT_S)
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(reader.write_reply(b"4", WAIT_S)))
        thread.start()
        assert writer.read_reply(1) == replies[0]
        thread.join(WAIT_S)
        assert outcome == [None]
        assert [writer.read_reply(1) for _ in range(3)] == [*replies[1:], b"4"]


def test_a_full_lane_of_a_closed_ring_raises_ring_closed() -> None:
    ring = ShmRingWriter(1, num_slots=4, slot_bytes=64, num_reply_slots=1, reply_slot_bytes=64)
    with ShmRingReader(ring.name, 0) as reader:
        reader.write_reply(b"first", WAIT_S)
        ring.close()
        with pytest.raises(RingClosedError, match="closed by its writer"):
            reader.write_reply(b"second", WAIT_S)


def test_a_reply_written_while_the_writer_sleeps_rings_its_doorbell(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 0) as reader:
        reader.write_reply(b"waiting", WAIT_S)
        assert writer.begin_reply_sleep([0]) is False, "slept on a reply already there"
        assert writer.read_reply(0) == b"waiting"
        assert writer.begin_reply_sleep([0]) is True
        try:
            reader.write_reply(b"wake", WAIT_S)
            readable, _, _ = select.select([writer.fileno()], [], [], WAIT_S)
            assert readable == [writer.fileno()]
        finally:
            writer.end_reply_sleep()
        assert writer.read_reply(0) == b"wake"
