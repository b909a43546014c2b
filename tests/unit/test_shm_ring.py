"""The shared-memory step ring in one process: every frame arrives once and in order at every
reader, whatever its size; a full ring blocks the writer until its deadline instead of overwriting;
attach, detach and close behave as DESIGN.md §1 asks; nothing is left in /dev/shm.

Blocking cases run the other side in a thread; the ring's doorbells are abstract-namespace unix
sockets, so no file or port is involved. Cross-process cases are in tests/integration.
"""

import os
import random
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol.shm_ring import (
    SEGMENT_PREFIX,
    ReaderState,
    RingAttachError,
    RingClosedError,
    RingLayout,
)
from worker.shm_ring_reader import SHM_FOLDER, ShmRingReader

SLOT_BYTES = 64  # 56 data bytes in a frame's first chunk, 64 in each later one
NUM_SLOTS = 4
WAIT_S = 30.0  # generous: a blocking test must end by a wake-up, never by this deadline
SHORT_S = 0.05  # for the waits that are meant to time out


def ring_segments() -> set[str]:
    return {name for name in os.listdir(SHM_FOLDER) if name.startswith(SEGMENT_PREFIX)}


@pytest.fixture
def writer() -> Iterator[ShmRingWriter]:
    ring = ShmRingWriter(2, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
    yield ring
    ring.close()
    assert ring.name not in ring_segments(), "the ring left its segment in /dev/shm"


def in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    """Run `fn` in a thread; its result or exception lands in the returned list."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(fn())  # type: ignore[operator]
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def joined(thread: threading.Thread, outcome: list[object]) -> object:
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the thread is still blocked"
    return outcome[0]


def test_layout_counts_chunks_with_the_size_word_in_the_first() -> None:
    layout = RingLayout(1, NUM_SLOTS, SLOT_BYTES)
    assert [layout.num_chunks(n) for n in (0, 56, 57, 120, 121, 1000)] == [1, 1, 2, 2, 3, 16]
    assert layout.size_bytes == 3 * 64 + NUM_SLOTS * SLOT_BYTES
    assert layout.slot_offset(NUM_SLOTS + 1) == layout.slot_offset(1)


@pytest.mark.parametrize(
    "num_readers, num_slots, slot_bytes", [(0, 4, 64), (1, 0, 64), (1, 4, 100), (1, 4, 32)]
)
def test_layout_refuses_bad_bounds(num_readers: int, num_slots: int, slot_bytes: int) -> None:
    with pytest.raises(ValueError, match=r"must|outside"):
        RingLayout(num_readers, num_slots, slot_bytes)


def test_frames_of_every_size_arrive_in_order_at_every_reader(writer: ShmRingWriter) -> None:
    """Sizes around the chunk boundaries, and frames larger than the whole ring (they stream)."""
    rng = random.Random(1)
    sizes = [0, 1, 55, 56, 57, 120, 121, 256, 1000, *(rng.randrange(2000) for _ in range(300))]
    frames = [rng.randbytes(size) for size in sizes]
    readers = [ShmRingReader(writer.name, idx) for idx in range(2)]
    threads = [in_thread(lambda r=r: [r.read(WAIT_S) for _ in frames]) for r in readers]
    for frame in frames:
        writer.write(frame, WAIT_S)
    for (thread, outcome), reader in zip(threads, readers, strict=True):
        assert joined(thread, outcome) == frames
        reader.check_invariants()
        reader.close()
    writer.check_invariants()


def test_wrap_around_reuses_every_slot_without_mixing_frames(writer: ShmRingWriter) -> None:
    readers = [ShmRingReader(writer.name, idx) for idx in range(2)]
    for step_id in range(5 * NUM_SLOTS):
        frame = step_id.to_bytes(4, "little") * (1 + step_id % 14)
        writer.write(frame, WAIT_S)
        assert [r.read(WAIT_S) for r in readers] == [frame, frame]
        writer.check_invariants()
    assert writer.num_written == 5 * NUM_SLOTS
    for reader in readers:
        reader.close()


def test_slow_reader_blocks_the_writer_and_the_deadline_names_it(writer: ShmRingWriter) -> None:
    fast, slow = ShmRingReader(writer.name, 0), ShmRingReader(writer.name, 1)
    frames = [bytes([i]) * 8 for i in range(NUM_SLOTS)]
    for frame in frames:
        writer.write(frame, WAIT_S)
        assert fast.read(WAIT_S) == frame
    with pytest.raises(TimeoutError, match=rf"reader 1 \(pid {os.getpid()}, attached\)"):
        writer.write(b"overwrite?", SHORT_S)
    assert [slow.read(WAIT_S) for _ in frames] == frames, "a frame was overwritten"
    fast.close()
    slow.close()


def test_blocked_writer_resumes_when_the_slow_reader_reads(writer: ShmRingWriter) -> None:
    readers = [ShmRingReader(writer.name, idx) for idx in range(2)]
    frames = [bytes([i]) * 100 for i in range(NUM_SLOTS)]  # two chunks each: the ring fills twice
    thread, outcome = in_thread(lambda: [writer.write(frame, WAIT_S) for frame in frames])
    for frame in frames:
        assert readers[0].read(WAIT_S) == frame
        assert readers[1].read(WAIT_S) == frame
    assert joined(thread, outcome) == [None] * NUM_SLOTS
    for reader in readers:
        reader.close()


def test_a_reader_that_attaches_late_still_gets_every_frame(writer: ShmRingWriter) -> None:
    writer.write(b"step 1", WAIT_S)
    with ShmRingReader(writer.name, 0) as early, ShmRingReader(writer.name, 1) as late:
        assert early.read(WAIT_S) == late.read(WAIT_S) == b"step 1"
        assert writer.reader_states() == [ReaderState.ATTACHED, ReaderState.ATTACHED]


def test_a_detached_reader_no_longer_holds_back_the_writer(writer: ShmRingWriter) -> None:
    stays, leaves = ShmRingReader(writer.name, 0), ShmRingReader(writer.name, 1)
    leaves.close()
    assert writer.reader_states() == [ReaderState.ATTACHED, ReaderState.DETACHED]
    for step_id in range(3 * NUM_SLOTS):
        writer.write(str(step_id).encode(), SHORT_S)
        assert stays.read(WAIT_S) == str(step_id).encode()
    with pytest.raises(RingAttachError, match=r"reader 1 .* is detached"):
        ShmRingReader(writer.name, 1)
    stays.close()


def test_a_released_reader_slot_holds_no_frames_and_cannot_be_attached(
    writer: ShmRingWriter,
) -> None:
    """A rank that could not map the ring takes its steps over ZMQ: its slot must not fill up."""
    with ShmRingReader(writer.name, 0) as attached:
        writer.release_reader(1)
        for step_id in range(2 * NUM_SLOTS):
            writer.write(bytes([step_id]), SHORT_S)
            assert attached.read(WAIT_S) == bytes([step_id])
        with pytest.raises(RingAttachError, match=r"reader 1 .* is detached"):
            ShmRingReader(writer.name, 1)
        with pytest.raises(ValueError, match=r"reader 0 of ring .* is attached, expected waiting"):
            writer.release_reader(0)


def test_a_detach_wakes_a_writer_waiting_for_that_reader(writer: ShmRingWriter) -> None:
    fast, slow = ShmRingReader(writer.name, 0), ShmRingReader(writer.name, 1)
    frames = [bytes([i]) for i in range(NUM_SLOTS + 1)]
    thread, outcome = in_thread(lambda: [writer.write(frame, WAIT_S) for frame in frames])
    assert [fast.read(WAIT_S) for _ in range(NUM_SLOTS)] == frames[:NUM_SLOTS]
    assert thread.is_alive(), "the last frame went out while the slow reader held every slot"
    slow.close()
    assert fast.read(WAIT_S) == frames[-1]
    assert joined(thread, outcome) == [None] * len(frames)
    fast.close()


def test_attach_refuses_a_taken_slot_a_bad_index_and_a_missing_ring(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 0):
        with pytest.raises(RingAttachError, match=r"reader 0 of ring .* is already attached"):
            ShmRingReader(writer.name, 0)
        with pytest.raises(RingAttachError, match=r"reader index 2 is outside \[0, 2\)"):
            ShmRingReader(writer.name, 2)
    with pytest.raises(RingAttachError, match="no ring kvserve-ring-nothing"):
        ShmRingReader(f"{SEGMENT_PREFIX}nothing", 0)


def test_attach_refuses_a_segment_that_is_not_a_ring() -> None:
    segment = shared_memory.SharedMemory(f"{SEGMENT_PREFIX}garbage-{os.getpid()}", True, 4096)
    try:
        with pytest.raises(RingAttachError, match="is not a kvserve ring"):
            ShmRingReader(segment.name, 0)
    finally:
        segment.close()
        segment.unlink()


def test_attach_refuses_a_ring_whose_writer_doorbell_it_cannot_reach() -> None:
    """Guards against a reader in another network namespace (the doorbells are abstract unix
    sockets) that would sleep through every frame: it must fail at attach, not at a deadline."""
    layout = RingLayout(1, NUM_SLOTS, SLOT_BYTES)
    name = f"{SEGMENT_PREFIX}no-writer-{os.getpid()}"
    segment = shared_memory.SharedMemory(name, True, layout.size_bytes)
    words = segment.buf.cast("Q")
    try:
        layout.write_header(words, os.getpid())
        with pytest.raises(RingAttachError, match="has no doorbell this process can reach"):
            ShmRingReader(name, 0)
    finally:
        words.release()
        segment.close()
        segment.unlink()


def test_a_blocked_reader_notices_the_writer_close_after_the_last_frame() -> None:
    ring = ShmRingWriter(1, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
    reader = ShmRingReader(ring.name, 0)
    ring.write(b"last step", WAIT_S)
    assert reader.read(WAIT_S) == b"last step"
    thread, outcome = in_thread(lambda: reader.read(WAIT_S))
    ring.write(b"written before the close", WAIT_S)
    ring.close()
    first = joined(thread, outcome)
    assert first == b"written before the close"
    with pytest.raises(RingClosedError, match="closed by its writer"):
        reader.read(WAIT_S)
    with pytest.raises(RingClosedError, match="closed by its writer"):
        reader.read_if_ready(WAIT_S)
    reader.close()


def test_a_sleeping_reader_wakes_with_ring_closed_when_the_writer_closes() -> None:
    ring = ShmRingWriter(1, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES)
    reader = ShmRingReader(ring.name, 0, spin_s=0.0)
    thread, outcome = in_thread(lambda: reader.read(WAIT_S))
    ring.close()
    assert isinstance(joined(thread, outcome), RingClosedError)
    reader.close()


def test_an_empty_ring_read_times_out_naming_the_reader(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 1, spin_s=0.0) as reader:
        with pytest.raises(TimeoutError, match=r"reader 1 got no frame on ring .* in 0.05 s"):
            reader.read(SHORT_S)
        assert reader.read_if_ready(WAIT_S) is None


def test_begin_sleep_refuses_to_sleep_on_a_waiting_frame(writer: ShmRingWriter) -> None:
    """Guards against a lost wake-up: the frame came before the asleep flag was set."""
    with ShmRingReader(writer.name, 0) as reader:
        assert reader.begin_sleep() is True
        reader.end_sleep()
        writer.write(b"step", WAIT_S)
        assert reader.begin_sleep() is False
        assert reader.read_if_ready(WAIT_S) == b"step"


def test_a_frame_written_while_the_reader_sleeps_rings_its_doorbell(writer: ShmRingWriter) -> None:
    with ShmRingReader(writer.name, 0) as reader:
        assert reader.begin_sleep()
        writer.write(b"step", WAIT_S)
        assert os.read(reader.fileno(), 64) == b"\1"
        reader.end_sleep()
        assert reader.read_if_ready(WAIT_S) == b"step"


def test_close_unlinks_the_segment_once() -> None:
    ring = ShmRingWriter(1)
    assert ring.name in ring_segments()
    ring.close()
    ring.close()
    assert ring.name not in ring_segments()
    with pytest.raises(RingClosedError, match="is closed; cannot write a frame"):
        ring.write(b"step", WAIT_S)


class RingMachine(RuleBasedStateMachine):
    """Random writes, reads and detaches against one queue of expected frames per reader."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = ShmRingWriter(3, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES, spin_s=0.0)
        self.readers = {idx: ShmRingReader(self.ring.name, idx, 0.0) for idx in range(3)}
        self.pending: dict[int, list[bytes]] = {idx: [] for idx in range(3)}
        self.num_frames = 0

    def _free_chunks(self) -> int:
        layout = self.ring.layout
        unread = [
            sum(layout.num_chunks(len(frame)) for frame in self.pending[idx])
            for idx in self.readers
        ]
        return layout.num_slots - max(unread, default=0)

    @rule(size=st.integers(0, 56 + 3 * SLOT_BYTES))
    def write(self, size: int) -> None:
        if self.ring.layout.num_chunks(size) > self._free_chunks():
            with pytest.raises(TimeoutError, match="the writer does not overwrite"):
                self.ring.write(b"\0" * size, 0.0)
            return  # the ring refused it whole; nothing of it was published
        self.num_frames += 1
        frame = self.num_frames.to_bytes(4, "little")[: min(size, 4)].ljust(size, b"x")
        self.ring.write(frame, WAIT_S)
        for idx in self.readers:
            self.pending[idx].append(frame)

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        idx = data.draw(st.sampled_from(sorted(self.readers)))
        reader = self.readers[idx]
        if not self.pending[idx]:
            assert reader.read_if_ready(WAIT_S) is None
            return
        assert reader.read(WAIT_S) == self.pending[idx].pop(0)

    @precondition(lambda self: len(self.readers) > 1)
    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        idx = data.draw(st.sampled_from(sorted(self.readers)))
        self.readers.pop(idx).close()
        del self.pending[idx]

    @invariant()
    def consistent(self) -> None:
        self.ring.check_invariants()
        for reader in self.readers.values():
            reader.check_invariants()

    def teardown(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.ring.close()


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
