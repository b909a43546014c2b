"""The byte layout of the shared-memory step ring, shared by its writer (engine_core) and readers
(worker) the way a codec is: fixed offsets, and the host id both sides compare; no other I/O, no
policy. The ring's behaviour (flow control, spin then block, deadlines, unlinking) lives with the
writer and the readers.

It must never import anything but the standard library.
"""

import enum
import threading
from dataclasses import dataclass

RING_MAGIC = int.from_bytes(b"kvsring1", "little")  # word 0 of every segment
SEGMENT_PREFIX = "kvserve-ring-"  # every segment's name starts so; tests look for leftovers by it
WORD_BYTES = 8
LINE_BYTES = 64  # one cache line: fields written by different processes never share one
WORDS_PER_LINE = LINE_BYTES // WORD_BYTES
FRAME_HEADER_BYTES = 8  # a frame's first chunk opens with its size in bytes, one word
MIN_SLOT_BYTES = LINE_BYTES
MAX_NUM_READERS = 256
MAX_SLOT_BYTES = 1 << 30
# Linux's id of this boot of this machine: the engine and a rank share a ring only when theirs
# agree (a hostname can repeat across hosts; a container may share the host's boot id but not its
# /dev/shm, which the reader's attach then finds out)
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# word indices of the header; line 0 is written once by the writer before any reader attaches
MAGIC_WORD, NUM_READERS_WORD, NUM_SLOTS_WORD, SLOT_BYTES_WORD, WRITER_PID_WORD = range(5)
NUM_REPLY_SLOTS_WORD, REPLY_SLOT_BYTES_WORD = 5, 6  # each reader's reply lane; 0: no lanes
# line 1 is written only by the writer
NUM_WRITTEN_WORD = WORDS_PER_LINE  # chunks published so far; chunk n lives in slot n % num_slots
IS_CLOSED_WORD = WORDS_PER_LINE + 1  # 1 once the writer wrote its last chunk
IS_WRITER_ASLEEP_WORD = WORDS_PER_LINE + 2  # 1 while the writer blocks on its doorbell
# line 2 + i belongs to reader i, and only reader i writes it
NUM_READ_FIELD, STATE_FIELD, IS_ASLEEP_FIELD, PID_FIELD = range(4)


class ReaderState(enum.IntEnum):
    """A reader slot's state, as stored in its STATE_FIELD word."""

    WAITING = 0  # reserved for a reader that has not attached yet; counts for flow control
    ATTACHED = 1
    DETACHED = 2  # left for good; the writer no longer waits for it, and it cannot come back


class RingAttachError(RuntimeError):
    """A reader could not attach: no such ring, not a ring, a bad index, or the slot is taken."""


class ReplyTooLargeError(ValueError):
    """A reply does not fit in one slot of its reader's reply lane."""


class RingClosedError(RuntimeError):
    """The ring is closed: its writer closed it (a reader gets this once every frame before the
    close was read) or its writer's process exited."""


class RingReaderGoneError(RuntimeError):
    """The writer waited on a reader whose process exited without detaching."""


@dataclass(frozen=True, slots=True)
class RingLayout:
    """Where everything lives in a segment of `size_bytes`:

    ```
    line 0            magic, num_readers, num_slots, slot_bytes, writer_pid,
                      num_reply_slots, reply_slot_bytes
    line 1            num_written, is_closed, is_writer_asleep            (writer only)
    line 2 + i        num_read, state, is_asleep, pid                     (reader i only)
    slot 0..S-1       chunks of slot_bytes; a frame's first chunk opens with its size (one word)
    lane i            reader i's replies to the writer:
                        a line of num_replies_written                     (reader i only)
                        a line of num_replies_read                        (writer only)
                        reply slot 0..R-1 of reply_slot_bytes, each opening with its size
    ```

    A frame larger than one slot spans consecutive chunks, and one larger than the whole ring
    streams through it, so frames of any size are carried. Counters only grow (chunk n is in slot
    n % num_slots) and are each written by one process: a reader may read chunk n once
    num_written > n, the writer may write it once every reader that is not DETACHED has
    num_read > n - num_slots. A lane works the same way with its reader as the only writer and
    the ring's writer as the only reader, one reply per slot (a reply never spans slots).
    """

    num_readers: int
    num_slots: int
    slot_bytes: int  # a multiple of LINE_BYTES, frame header included
    num_reply_slots: int = 0  # per reader's lane; 0: replies go elsewhere (ZMQ)
    reply_slot_bytes: int = 0  # a multiple of LINE_BYTES, size word included

    def __post_init__(self) -> None:
        if not 1 <= self.num_readers <= MAX_NUM_READERS:
            raise ValueError(f"num_readers={self.num_readers} is outside [1, {MAX_NUM_READERS}]")
        if self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots} must be at least 1")
        if not MIN_SLOT_BYTES <= self.slot_bytes <= MAX_SLOT_BYTES or self.slot_bytes % LINE_BYTES:
            raise ValueError(
                f"slot_bytes={self.slot_bytes} must be a multiple of {LINE_BYTES} "
                f"in [{MIN_SLOT_BYTES}, {MAX_SLOT_BYTES}]"
            )
        if self.num_reply_slots < 0 or (
            self.num_reply_slots
            and (
                not MIN_SLOT_BYTES <= self.reply_slot_bytes <= MAX_SLOT_BYTES
                or self.reply_slot_bytes % LINE_BYTES
            )
        ):
            raise ValueError(
                f"num_reply_slots={self.num_reply_slots} with reply_slot_bytes="
                f"{self.reply_slot_bytes}: expected no lanes, or slots of a multiple of "
                f"{LINE_BYTES} bytes in [{MIN_SLOT_BYTES}, {MAX_SLOT_BYTES}]"
            )

    @property
    def header_bytes(self) -> int:
        return (2 + self.num_readers) * LINE_BYTES

    @property
    def lane_bytes(self) -> int:
        if not self.num_reply_slots:
            return 0
        return 2 * LINE_BYTES + self.num_reply_slots * self.reply_slot_bytes

    @property
    def size_bytes(self) -> int:
        lanes_bytes = self.num_readers * self.lane_bytes
        return self.header_bytes + self.num_slots * self.slot_bytes + lanes_bytes

    def lane_offset(self, reader_idx: int) -> int:
        """Byte offset of reader `reader_idx`'s reply lane (its num_replies_written line)."""
        return self.header_bytes + self.num_slots * self.slot_bytes + reader_idx * self.lane_bytes

    def lane_written_word(self, reader_idx: int) -> int:
        return self.lane_offset(reader_idx) // WORD_BYTES

    def lane_read_word(self, reader_idx: int) -> int:
        return (self.lane_offset(reader_idx) + LINE_BYTES) // WORD_BYTES

    def reply_slot_offset(self, reader_idx: int, reply_idx: int) -> int:
        """Byte offset of the slot that carries reply `reply_idx` of reader `reader_idx`."""
        slot_idx = reply_idx % self.num_reply_slots
        return self.lane_offset(reader_idx) + 2 * LINE_BYTES + slot_idx * self.reply_slot_bytes

    def reader_word(self, reader_idx: int, field: int) -> int:
        return (2 + reader_idx) * WORDS_PER_LINE + field

    def slot_offset(self, chunk_idx: int) -> int:
        """Byte offset of the slot that carries chunk `chunk_idx`."""
        return self.header_bytes + (chunk_idx % self.num_slots) * self.slot_bytes

    def num_chunks(self, frame_bytes: int) -> int:
        """Chunks a frame of `frame_bytes` takes: the first holds the size word too."""
        first_data_bytes = self.slot_bytes - FRAME_HEADER_BYTES
        if frame_bytes <= first_data_bytes:
            return 1
        return 1 + -(-(frame_bytes - first_data_bytes) // self.slot_bytes)

    def write_header(self, words: memoryview, writer_pid: int) -> None:
        """Fill line 0 of a fresh segment (`words` is the segment cast to unsigned 64-bit)."""
        words[NUM_READERS_WORD] = self.num_readers
        words[NUM_SLOTS_WORD] = self.num_slots
        words[SLOT_BYTES_WORD] = self.slot_bytes
        words[WRITER_PID_WORD] = writer_pid
        words[NUM_REPLY_SLOTS_WORD] = self.num_reply_slots
        words[REPLY_SLOT_BYTES_WORD] = self.reply_slot_bytes
        words[MAGIC_WORD] = RING_MAGIC  # last: a segment without it is not a ring yet

    @classmethod
    def from_header(cls, words: memoryview, size_bytes: int, name: str) -> "RingLayout":
        """The layout a segment's line 0 declares, checked against the segment's size."""
        if size_bytes < 2 * LINE_BYTES or words[MAGIC_WORD] != RING_MAGIC:
            raise RingAttachError(f"segment {name} of {size_bytes} bytes is not a kvserve ring")
        try:
            layout = cls(
                words[NUM_READERS_WORD],
                words[NUM_SLOTS_WORD],
                words[SLOT_BYTES_WORD],
                words[NUM_REPLY_SLOTS_WORD],
                words[REPLY_SLOT_BYTES_WORD],
            )
        except ValueError as exc:
            raise RingAttachError(f"segment {name} has a bad header: {exc}") from None
        if layout.size_bytes != size_bytes:
            raise RingAttachError(
                f"segment {name} is {size_bytes} bytes, its header says {layout.size_bytes}"
            )
        return layout


def read_host_id() -> str | None:
    """This boot of this machine, as WorkerHello carries it; None where Linux tells none."""
    try:
        with open(BOOT_ID_PATH) as file:
            return file.read().strip() or None
    except OSError:
        return None


def reader_doorbell_address(ring_name: str, reader_idx: int) -> bytes:
    """The abstract-namespace unix datagram address reader `reader_idx` is woken at: no file
    exists, so a crash leaves nothing behind, and a second bind of one slot fails."""
    return f"\0{ring_name}/reader-{reader_idx}".encode()


def writer_doorbell_address(ring_name: str) -> bytes:
    return f"\0{ring_name}/writer".encode()


class MemoryFence:
    """A full memory barrier between the caller's loads and stores on the shared segment.

    Acquiring and releasing an uncontended lock executes a locked instruction, which on x86-64
    orders every earlier load and store before every later one. The ring needs this where one
    side stores a flag and then loads the other side's counter (asleep flag vs. num_written):
    without it, both could miss the other and a wake-up would be lost.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            pass
