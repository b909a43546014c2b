"""ShmRingWriter: the engine's side of the shared-memory step ring for same-host ranks. It owns the
segment (creates it, unlinks it exactly once), publishes each step's encoded frame to every reader,
blocks, never overwrites, when a reader falls behind, and takes the replies readers leave in their
reply lanes.

Every wait has a deadline. It never decodes a frame and never touches a ZMQ socket.
"""

import contextlib
import logging
import math
import os
import secrets
import select
import socket
import time
from multiprocessing import shared_memory

from protocol.shm_ring import (
    FRAME_HEADER_BYTES,
    IS_ASLEEP_FIELD,
    IS_CLOSED_WORD,
    IS_WRITER_ASLEEP_WORD,
    NUM_READ_FIELD,
    NUM_WRITTEN_WORD,
    PID_FIELD,
    SEGMENT_PREFIX,
    STATE_FIELD,
    MemoryFence,
    ReaderState,
    RingClosedError,
    RingLayout,
    RingReaderGoneError,
    reader_doorbell_address,
    writer_doorbell_address,
)

logger = logging.getLogger(__name__)

SPIN_S = 50e-6  # how long a full ring is re-checked (yielding the CPU) before the writer blocks
NUM_SLOTS = 16
SLOT_BYTES = 256 * 1024  # a 256-request decode step is ~3 KB and an 8 x 2,048 prefill ~70 KB
# A ModelRunnerOutput takes 8 bytes per request, and up to 172 more with logprobs=20 (21 float32
# values and 21 int32 ids, a rank): 16 MiB holds one for max_num_seqs's bound of 65,536 requests.
# Pages of /dev/shm are used only where written, so a small reply costs one page.
REPLY_SLOT_BYTES = 16 << 20


class ShmRingWriter:
    """One writer, `num_readers` readers, over one `multiprocessing.shared_memory` segment.

    Invariants: for every reader not DETACHED, 0 <= num_written - num_read <= num_slots (no chunk
    is overwritten before every such reader read it); `num_written` only grows; the segment is
    unlinked once, by `close`, and nothing is written after it.
    """

    def __init__(
        self,
        num_readers: int,
        num_slots: int = NUM_SLOTS,
        slot_bytes: int = SLOT_BYTES,
        spin_s: float = SPIN_S,
        num_reply_slots: int = 0,
        reply_slot_bytes: int = REPLY_SLOT_BYTES,
    ) -> None:
        """With `num_reply_slots`, each reader gets a reply lane of that many slots."""
        lane_slot_bytes = reply_slot_bytes if num_reply_slots else 0
        self.layout = RingLayout(
            num_readers, num_slots, slot_bytes, num_reply_slots, lane_slot_bytes
        )
        self.spin_s = spin_s
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        # registered with Python's resource tracker: if this process dies, the tracker unlinks it
        self._shm = shared_memory.SharedMemory(self.name, create=True, size=self.layout.size_bytes)
        self._bytes = self._shm.buf
        self._words = self._bytes.cast("Q")
        self.layout.write_header(self._words, os.getpid())
        self._doorbell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._doorbell.setblocking(False)
        self._doorbell.bind(writer_doorbell_address(self.name))
        self._fence = MemoryFence()
        self._reader_addresses = [reader_doorbell_address(self.name, i) for i in range(num_readers)]
        self._pidfds: dict[int, tuple[int, int]] = {}  # reader idx -> (pid, pidfd), while waited on
        self.num_written = 0
        self.num_replies_read = [0] * num_readers  # per reader, replies taken from its lane
        self._min_num_read = 0  # a lower bound on what every live reader has read
        self.is_closed = False

    # -- writing -------------------------------------------------------------------------------

    def write(self, frame: bytes, timeout_s: float) -> None:
        """Publish `frame` to every reader; waits at most `timeout_s` in all for room, and
        raises TimeoutError naming the slowest reader rather than overwrite.

        A frame that fits in the ring waits for room for all its chunks, so a timeout publishes
        nothing of it. A larger one streams through chunk by chunk; a timeout in its middle
        closes the ring, since its readers could never finish that frame.
        """
        if self.is_closed:
            raise RingClosedError(f"ring {self.name} is closed; cannot write a frame")
        deadline = time.monotonic() + timeout_s
        data = memoryview(frame).cast("B")
        layout, words, num_bytes = self.layout, self._words, len(data)
        num_chunks = layout.num_chunks(num_bytes)
        self._make_room(min(num_chunks, layout.num_slots), deadline, timeout_s)
        start = 0
        for chunk_idx in range(num_chunks):
            if chunk_idx >= layout.num_slots:
                try:
                    self._make_room(1, deadline, timeout_s)
                except BaseException:
                    self.close()
                    raise
            offset = layout.slot_offset(self.num_written)
            if chunk_idx == 0:
                words[offset // 8] = num_bytes
                offset += FRAME_HEADER_BYTES
            end = min(num_bytes, start + self._data_bytes(chunk_idx))
            self._bytes[offset : offset + end - start] = data[start:end]
            start = end
            self._publish()

    def _data_bytes(self, chunk_idx: int) -> int:
        return self.layout.slot_bytes - (FRAME_HEADER_BYTES if chunk_idx == 0 else 0)

    def _publish(self) -> None:
        """Make one more chunk visible, then ring the doorbell of every reader asleep on it."""
        words, layout = self._words, self.layout
        self._fence()  # the chunk's bytes before the counter that exposes them
        self.num_written += 1
        words[NUM_WRITTEN_WORD] = self.num_written
        self._fence()  # the counter before the asleep flags (see MemoryFence)
        for reader_idx, address in enumerate(self._reader_addresses):
            if words[layout.reader_word(reader_idx, IS_ASLEEP_FIELD)]:
                self._ring(address)

    def _ring(self, address: bytes) -> None:
        # already woken (its queue is full) or gone (the flow control sees to that)
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self._doorbell.sendto(b"\1", address)

    # -- waiting for a slow reader -------------------------------------------------------------

    def slowest_reader(self) -> tuple[int | None, int]:
        """The live reader furthest behind and what it has read (None: every reader left)."""
        layout, words = self.layout, self._words
        slowest, min_num_read = None, self.num_written
        for reader_idx in range(layout.num_readers):
            if words[layout.reader_word(reader_idx, STATE_FIELD)] == ReaderState.DETACHED:
                continue
            num_read = words[layout.reader_word(reader_idx, NUM_READ_FIELD)]
            if slowest is None or num_read < min_num_read:
                slowest, min_num_read = reader_idx, num_read
        return slowest, min_num_read

    def _has_room(self, num_chunks: int) -> tuple[bool, int | None]:
        slowest, self._min_num_read = self.slowest_reader()
        return self.num_written + num_chunks - self._min_num_read <= self.layout.num_slots, slowest

    def _make_room(self, num_chunks: int, deadline: float, timeout_s: float) -> None:
        """Until `num_chunks` slots are free: spin for `spin_s`, then sleep on the doorbell that
        readers ring after a read."""
        if self.num_written + num_chunks - self._min_num_read <= self.layout.num_slots:
            return  # the bound cached at the last check still allows it
        spin_until = time.monotonic() + self.spin_s
        has_room, slowest = self._has_room(num_chunks)
        while not has_room and time.monotonic() < spin_until:
            os.sched_yield()
            has_room, slowest = self._has_room(num_chunks)
        while not has_room:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(self._describe_stall(slowest, timeout_s))
            self._sleep(num_chunks, slowest, remaining_s)
            has_room, slowest = self._has_room(num_chunks)

    def _sleep(self, num_chunks: int, slowest: int | None, remaining_s: float) -> None:
        words = self._words
        words[IS_WRITER_ASLEEP_WORD] = 1
        self._fence()  # the flag before the re-check (see MemoryFence)
        try:
            if self._has_room(num_chunks)[0]:
                return
            poller = select.poll()
            poller.register(self._doorbell, select.POLLIN)
            pidfd = self._reader_pidfd(slowest)
            if pidfd is not None:
                poller.register(pidfd, select.POLLIN)
            events = dict(poller.poll(math.ceil(remaining_s * 1000)))
            if pidfd is not None and pidfd in events and not self._has_room(num_chunks)[0]:
                raise RingReaderGoneError(self._describe_stall(slowest, None))
        finally:
            words[IS_WRITER_ASLEEP_WORD] = 0
            self._drain_doorbell()

    def _reader_pidfd(self, reader_idx: int | None) -> int | None:
        """A pidfd of the reader's process, so its death ends the wait (None: not attached yet)."""
        if reader_idx is None:
            return None
        pid = self._words[self.layout.reader_word(reader_idx, PID_FIELD)]
        if not pid:
            return None
        known = self._pidfds.get(reader_idx)
        if known is not None and known[0] == pid:
            return known[1]
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise RingReaderGoneError(self._describe_stall(reader_idx, None)) from None
        self._pidfds[reader_idx] = (pid, pidfd)
        return pidfd

    def _describe_stall(self, reader_idx: int | None, timeout_s: float | None) -> str:
        layout = self.layout
        if reader_idx is None:
            return f"ring {self.name}: no room and no reader"
        pid = self._words[layout.reader_word(reader_idx, PID_FIELD)]
        state = ReaderState(self._words[layout.reader_word(reader_idx, STATE_FIELD)]).name
        num_read = self._words[layout.reader_word(reader_idx, NUM_READ_FIELD)]
        who = f"ring {self.name}: reader {reader_idx} (pid {pid or 'none'}, {state.lower()})"
        behind = f"{self.num_written - num_read} of {layout.num_slots} slots unread"
        if timeout_s is None:
            return f"{who} exited with {behind}"
        return f"{who} read nothing in {timeout_s} s with {behind}; the writer does not overwrite"

    def _drain_doorbell(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self._doorbell.recv(64)

    # -- replies ---------------------------------------------------------------------------------

    def has_reply(self, reader_idx: int) -> bool:
        written = self._words[self.layout.lane_written_word(reader_idx)]
        return written > self.num_replies_read[reader_idx]

    def read_reply(self, reader_idx: int) -> bytes | None:
        """The next reply in reader `reader_idx`'s lane, or None when there is none yet."""
        if not self.has_reply(reader_idx):
            return None
        layout, words = self.layout, self._words
        self._fence()  # the counter that exposed the reply before the reply's bytes
        offset = layout.reply_slot_offset(reader_idx, self.num_replies_read[reader_idx])
        num_bytes = words[offset // 8]
        reply = bytes(
            self._bytes[offset + FRAME_HEADER_BYTES : offset + FRAME_HEADER_BYTES + num_bytes]
        )
        self._fence()  # the copy before the slot is handed back
        self.num_replies_read[reader_idx] += 1
        words[layout.lane_read_word(reader_idx)] = self.num_replies_read[reader_idx]
        return reply

    def begin_reply_sleep(self, reader_idxs: list[int]) -> bool:
        """Announce that the writer is about to block on `fileno()` for a reply of these readers;
        False (and no block) when one is already there. Every True is followed by
        `end_reply_sleep`."""
        self._words[IS_WRITER_ASLEEP_WORD] = 1
        self._fence()  # the flag before the re-check of the lanes (see MemoryFence)
        if any(self.has_reply(reader_idx) for reader_idx in reader_idxs):
            self._words[IS_WRITER_ASLEEP_WORD] = 0
            return False
        return True

    def end_reply_sleep(self) -> None:
        self._words[IS_WRITER_ASLEEP_WORD] = 0
        self._drain_doorbell()

    def fileno(self) -> int:
        """The doorbell: readable after a reader released a slot or left a reply while the
        writer slept."""
        return self._doorbell.fileno()

    # -- closing -------------------------------------------------------------------------------

    def reader_states(self) -> list[ReaderState]:
        layout = self.layout
        return [
            ReaderState(self._words[layout.reader_word(i, STATE_FIELD)])
            for i in range(layout.num_readers)
        ]

    def release_reader(self, reader_idx: int) -> None:
        """Stop holding frames for a reader that will never attach (its rank could not map the
        ring and takes its steps over ZMQ): its WAITING slot becomes DETACHED. Call it only once
        that rank has said so, since an attach racing with it could be overwritten."""
        word = self.layout.reader_word(reader_idx, STATE_FIELD)
        state = ReaderState(self._words[word])
        if state != ReaderState.WAITING:
            raise ValueError(
                f"reader {reader_idx} of ring {self.name} is {state.name.lower()}, expected waiting"
            )
        self._words[word] = ReaderState.DETACHED

    def close(self) -> None:
        """Mark the ring closed, wake every reader so it sees that, and unlink the segment (once).

        Readers still mapped keep their memory, read what was written before, then get
        RingClosedError.
        """
        if self.is_closed:
            return
        self.is_closed = True
        self._words[IS_CLOSED_WORD] = 1
        self._fence()
        for address in self._reader_addresses:
            self._ring(address)
        for _, pidfd in self._pidfds.values():
            os.close(pidfd)
        self._pidfds.clear()
        self._doorbell.close()
        self._words.release()
        self._bytes = self._words = None  # type: ignore[assignment]  # the buffer must be free
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> "ShmRingWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        assert not self.is_closed, f"ring {self.name} is closed"
        layout, words = self.layout, self._words
        assert words[NUM_WRITTEN_WORD] == self.num_written, (
            f"num_written {words[NUM_WRITTEN_WORD]} in the header, {self.num_written} here"
        )
        for reader_idx, state in enumerate(self.reader_states()):
            if state == ReaderState.DETACHED:
                continue
            num_read = words[layout.reader_word(reader_idx, NUM_READ_FIELD)]
            assert 0 <= self.num_written - num_read <= layout.num_slots, (
                f"reader {reader_idx} has read {num_read} of {self.num_written} chunks "
                f"in a ring of {layout.num_slots} slots"
            )
        for reader_idx in range(layout.num_readers if layout.num_reply_slots else 0):
            num_unread = (
                words[layout.lane_written_word(reader_idx)] - self.num_replies_read[reader_idx]
            )
            assert 0 <= num_unread <= layout.num_reply_slots, (
                f"reader {reader_idx}'s lane holds {num_unread} unread replies "
                f"in {layout.num_reply_slots} slots"
            )
