"""ShmRingReader: one same-host rank's side of the engine's shared-memory step ring. It reads every
frame exactly once, in order, spinning briefly and then blocking on its doorbell, notices a writer
that closed the ring or died, and leaves its replies in its own reply lane when the ring has lanes.

It never writes a step, never unlinks the segment (the writer owns it) and never decodes.
"""

import contextlib
import math
import mmap
import os
import select
import socket
import time

from protocol.shm_ring import (
    FRAME_HEADER_BYTES,
    IS_ASLEEP_FIELD,
    IS_CLOSED_WORD,
    IS_WRITER_ASLEEP_WORD,
    NUM_READ_FIELD,
    NUM_WRITTEN_WORD,
    PID_FIELD,
    STATE_FIELD,
    WRITER_PID_WORD,
    MemoryFence,
    ReaderState,
    ReplyTooLargeError,
    RingAttachError,
    RingClosedError,
    RingLayout,
    reader_doorbell_address,
    writer_doorbell_address,
)

SHM_FOLDER = "/dev/shm"  # where Linux keeps multiprocessing.shared_memory segments
SPIN_S = 200e-6  # how long an empty ring is re-checked (yielding the CPU) before blocking
LANE_FULL_POLL_MS = 1  # how often a full reply lane is re-checked (the writer rings no doorbell)


class ShmRingReader:
    """Reader `reader_idx` of the ring named `name`, attached until `close`.

    It maps the segment's file itself rather than through SharedMemory: before Python 3.13 an
    attaching SharedMemory registers with the resource tracker, which unlinks the segment when
    this process exits, under the writer's feet.

    Invariants: `num_read` equals this reader's NUM_READ word and never passes the writer's
    num_written; the slot's state is ATTACHED from attach to close.
    """

    def __init__(self, name: str, reader_idx: int, spin_s: float = SPIN_S) -> None:
        self.name, self.reader_idx, self.spin_s = name, reader_idx, spin_s
        try:
            fd = os.open(os.path.join(SHM_FOLDER, name), os.O_RDWR)
        except FileNotFoundError:
            raise RingAttachError(f"no ring {name} in {SHM_FOLDER}") from None
        try:
            size_bytes = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self._bytes = memoryview(self._mmap)
        self._words = self._bytes.cast("Q")
        self._doorbell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.layout = RingLayout.from_header(self._words, size_bytes, name)
            self._check_writer_is_visible()
            self._claim_slot()
        except BaseException:
            self._release_memory()
            raise
        self._fence = MemoryFence()
        self._writer_address = writer_doorbell_address(name)
        self.writer_pid = self._words[WRITER_PID_WORD]
        self._writer_pidfd: int | None = None
        self._poller = select.poll()
        self._poller.register(self._doorbell, select.POLLIN)
        self.num_read = self._words[self._word(NUM_READ_FIELD)]
        self.num_replies_written = 0
        if self.layout.num_reply_slots:
            self.num_replies_written = self._words[self.layout.lane_written_word(reader_idx)]
        self.is_closed = False

    def _word(self, field: int) -> int:
        return self.layout.reader_word(self.reader_idx, field)

    def _check_writer_is_visible(self) -> None:
        """A writer this process cannot see (another pid namespace) could never be watched, and
        its ring would look closed at the first sleep: refuse it now, before claiming a slot."""
        writer_pid = self._words[WRITER_PID_WORD]
        try:
            os.close(os.pidfd_open(writer_pid))
        except ProcessLookupError:
            raise RingAttachError(
                f"the writer of ring {self.name} (pid {writer_pid}) is no process this one can "
                f"see (it exited, or lives in another pid namespace)"
            ) from None

    def _claim_slot(self) -> None:
        """Bind the slot's doorbell (only one process can) and mark the slot ATTACHED."""
        if not 0 <= self.reader_idx < self.layout.num_readers:
            raise RingAttachError(
                f"reader index {self.reader_idx} is outside [0, {self.layout.num_readers}) "
                f"of ring {self.name}"
            )
        try:
            self._doorbell.bind(reader_doorbell_address(self.name, self.reader_idx))
        except OSError as exc:
            raise RingAttachError(
                f"reader {self.reader_idx} of ring {self.name} is already attached: {exc}"
            ) from None
        self._doorbell.setblocking(False)
        try:  # a writer in another network namespace could never ring this doorbell: say so now
            self._doorbell.sendto(b"\0", writer_doorbell_address(self.name))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise RingAttachError(
                f"the writer of ring {self.name} has no doorbell this process can reach "
                f"(closed, or another network namespace): {exc}"
            ) from None
        except BlockingIOError:
            pass  # its doorbell is full of wake-ups: it is there
        state = ReaderState(self._words[self._word(STATE_FIELD)])
        if state != ReaderState.WAITING:
            raise RingAttachError(
                f"reader {self.reader_idx} of ring {self.name} is {state.name.lower()}, "
                f"expected waiting; a new reader needs a fresh ring"
            )
        self._words[self._word(PID_FIELD)] = os.getpid()
        self._words[self._word(STATE_FIELD)] = ReaderState.ATTACHED

    # -- reading -------------------------------------------------------------------------------

    def read(self, timeout_s: float) -> bytes | bytearray:
        """The next frame, waiting at most `timeout_s` in all: TimeoutError after that,
        RingClosedError once the writer closed (and every earlier frame was read) or died."""
        deadline = time.monotonic() + timeout_s
        self._wait(deadline, timeout_s)
        return self._take_frame(deadline, timeout_s)

    def read_if_ready(self, timeout_s: float) -> bytes | bytearray | None:
        """The next frame if it has begun to arrive, else None; for a caller that polls the
        ring with other sockets (see `begin_sleep`). `timeout_s` bounds the rest of a frame."""
        if not self._is_ready():
            if self._words[IS_CLOSED_WORD] and not self._is_ready():
                raise RingClosedError(f"ring {self.name} was closed by its writer")
            return None
        return self._take_frame(time.monotonic() + timeout_s, timeout_s)

    def _is_ready(self) -> bool:
        return self._words[NUM_WRITTEN_WORD] > self.num_read

    def _take_frame(self, deadline: float, timeout_s: float) -> bytes | bytearray:
        """Copy out the frame whose first chunk is published, waiting for the chunks after it."""
        layout, words = self.layout, self._words
        self._fence()  # the counter that exposed the chunk before the chunk's bytes
        offset = layout.slot_offset(self.num_read)
        num_bytes = words[offset // 8]
        data_offset = offset + FRAME_HEADER_BYTES
        first_bytes = min(num_bytes, layout.slot_bytes - FRAME_HEADER_BYTES)
        if first_bytes == num_bytes:
            frame = bytes(self._bytes[data_offset : data_offset + num_bytes])
            self._release_chunk()
            return frame
        frame = bytearray(num_bytes)
        frame[:first_bytes] = self._bytes[data_offset : data_offset + first_bytes]
        self._release_chunk()
        start = first_bytes
        while start < num_bytes:
            self._wait(deadline, timeout_s)
            self._fence()
            offset = layout.slot_offset(self.num_read)
            end = min(num_bytes, start + layout.slot_bytes)
            frame[start:end] = self._bytes[offset : offset + end - start]
            self._release_chunk()
            start = end
        return frame

    def _release_chunk(self) -> None:
        """Hand one slot back to the writer, and wake it if it sleeps waiting for room."""
        self._fence()  # the chunk's bytes were copied before its slot is handed back
        self.num_read += 1
        self._words[self._word(NUM_READ_FIELD)] = self.num_read
        self._fence()  # the counter before the writer's asleep flag (see MemoryFence)
        if self._words[IS_WRITER_ASLEEP_WORD]:
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                self._doorbell.sendto(b"\1", self._writer_address)

    # -- replying -------------------------------------------------------------------------------

    @property
    def has_reply_lane(self) -> bool:
        return self.layout.num_reply_slots > 0

    def write_reply(self, frame: bytes, timeout_s: float) -> None:
        """Leave `frame` in this reader's reply lane and wake the writer if it sleeps. A full lane
        (the writer took none of the last num_reply_slots replies) is waited on for `timeout_s`
        at most; ReplyTooLargeError for a frame larger than a slot."""
        layout, words = self.layout, self._words
        if len(frame) > layout.reply_slot_bytes - FRAME_HEADER_BYTES:
            raise ReplyTooLargeError(
                f"a reply of {len(frame)} bytes does not fit in a reply slot of ring {self.name} "
                f"({layout.reply_slot_bytes - FRAME_HEADER_BYTES} bytes)"
            )
        self._wait_for_lane_room(time.monotonic() + timeout_s, timeout_s)
        offset = layout.reply_slot_offset(self.reader_idx, self.num_replies_written)
        words[offset // 8] = len(frame)
        data_offset = offset + FRAME_HEADER_BYTES
        self._bytes[data_offset : data_offset + len(frame)] = frame
        self._fence()  # the reply's bytes before the counter that exposes them
        self.num_replies_written += 1
        words[layout.lane_written_word(self.reader_idx)] = self.num_replies_written
        self._fence()  # the counter before the writer's asleep flag (see MemoryFence)
        if words[IS_WRITER_ASLEEP_WORD]:
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                self._doorbell.sendto(b"\1", self._writer_address)

    def _wait_for_lane_room(self, deadline: float, timeout_s: float) -> None:
        layout, words = self.layout, self._words
        read_word = layout.lane_read_word(self.reader_idx)
        while self.num_replies_written - words[read_word] >= layout.num_reply_slots:
            if words[IS_CLOSED_WORD]:
                raise RingClosedError(f"ring {self.name} was closed by its writer")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"reader {self.reader_idx} of ring {self.name}: the writer took none of its "
                    f"last {layout.num_reply_slots} replies in {timeout_s} s"
                )
            self._watch_writer()
            events = dict(self._poller.poll(LANE_FULL_POLL_MS))
            self.end_sleep()  # drains a wake-up meant for the step ring, which cannot help here
            if self._writer_pidfd in events:
                raise RingClosedError(
                    f"the writer of ring {self.name} (pid {self.writer_pid}) died"
                )

    # -- waiting -------------------------------------------------------------------------------

    def _wait(self, deadline: float, timeout_s: float) -> None:
        """Until the next chunk is published: spin for `spin_s`, then block on the doorbell."""
        if self.spin(deadline):
            return
        while not self._is_ready():
            if self._words[IS_CLOSED_WORD] and not self._is_ready():
                raise RingClosedError(f"ring {self.name} was closed by its writer")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(
                    f"reader {self.reader_idx} got no frame on ring {self.name} in {timeout_s} s"
                )
            if not self.begin_sleep():
                continue
            try:
                events = dict(self._poller.poll(math.ceil(remaining_s * 1000)))
            finally:
                self.end_sleep()
            if self._writer_pidfd in events and not self._is_ready():
                raise RingClosedError(
                    f"the writer of ring {self.name} (pid {self.writer_pid}) died"
                )

    def spin(self, deadline: float | None = None) -> bool:
        """Re-check for `spin_s` (until `deadline` at most), yielding the CPU between checks;
        True once a chunk is published. Spinning only briefly keeps readers from starving the
        engine when processes outnumber cores."""
        if self._is_ready():
            return True
        spin_until = time.monotonic() + self.spin_s
        if deadline is not None:
            spin_until = min(spin_until, deadline)
        while time.monotonic() < spin_until:
            os.sched_yield()
            if self._is_ready():
                return True
        return False

    def begin_sleep(self) -> bool:
        """Announce that this reader is about to block on `fileno()`; False (and no block) when a
        frame or the close is already there. Every True is followed by `end_sleep`."""
        words = self._words
        words[self._word(IS_ASLEEP_FIELD)] = 1
        self._fence()  # the flag before the re-check of num_written (see MemoryFence)
        if self._is_ready() or words[IS_CLOSED_WORD]:
            words[self._word(IS_ASLEEP_FIELD)] = 0
            return False
        self._watch_writer()
        return True

    def end_sleep(self) -> None:
        self._words[self._word(IS_ASLEEP_FIELD)] = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                self._doorbell.recv(64)

    def _watch_writer(self) -> None:
        """Put the writer's process in the poller once, so its death ends a sleep at once."""
        if self._writer_pidfd is not None:
            return
        try:
            self._writer_pidfd = os.pidfd_open(self.writer_pid)
        except ProcessLookupError:
            raise RingClosedError(
                f"the writer of ring {self.name} (pid {self.writer_pid}) died"
            ) from None
        self._poller.register(self._writer_pidfd, select.POLLIN)

    def fileno(self) -> int:
        """The doorbell: readable after the writer published while this reader slept."""
        return self._doorbell.fileno()

    # -- detaching -----------------------------------------------------------------------------

    def close(self) -> None:
        """Detach for good: the writer stops waiting for this reader."""
        if self.is_closed:
            return
        self.is_closed = True
        words = self._words
        words[self._word(IS_ASLEEP_FIELD)] = 0
        words[self._word(STATE_FIELD)] = ReaderState.DETACHED
        self._fence()
        if words[IS_WRITER_ASLEEP_WORD]:  # it may be waiting for room this reader held
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                self._doorbell.sendto(b"\1", self._writer_address)
        if self._writer_pidfd is not None:
            os.close(self._writer_pidfd)
        self._release_memory()

    def _release_memory(self) -> None:
        self._doorbell.close()
        self._words.release()
        self._bytes.release()
        self._mmap.close()

    def __enter__(self) -> "ShmRingReader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        words = self._words
        assert words[self._word(NUM_READ_FIELD)] == self.num_read, (
            f"reader {self.reader_idx}: {words[self._word(NUM_READ_FIELD)]} read in the header, "
            f"{self.num_read} here"
        )
        assert self.num_read <= words[NUM_WRITTEN_WORD], (
            f"reader {self.reader_idx} read {self.num_read} of {words[NUM_WRITTEN_WORD]} chunks"
        )
        state = ReaderState(words[self._word(STATE_FIELD)])
        assert state == ReaderState.ATTACHED, f"reader {self.reader_idx} is {state.name}"
