"""Process mains for the shared-memory ring tests, run as `python -c` from the repository root:
a reader that checks every frame it gets, a writer that publishes and then waits to be killed,
and a reader that attaches and then reads nothing."""

import random
import sys
import time
from pathlib import Path

from engine_core.workers.shm_ring_writer import ShmRingWriter
from protocol.shm_ring import RingClosedError
from worker.shm_ring_reader import ShmRingReader

READ_TIMEOUT_S = 60.0
IDLE_S = 60.0  # a peer that waits to be killed gives up after this long
MAX_FRAME_BYTES = 3000  # more than the rings of these tests hold, so some frames stream


def frames_for(seed: int, num_frames: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(MAX_FRAME_BYTES)) for _ in range(num_frames)]


def checking_reader(name: str, reader_idx: int, seed: int, num_frames: int) -> int:
    """Exit 0 if the frames arrive exactly as `frames_for` makes them and the close follows."""
    with ShmRingReader(name, reader_idx) as reader:
        for frame_idx, expected in enumerate(frames_for(seed, num_frames)):
            frame = reader.read(READ_TIMEOUT_S)
            if frame != expected:
                print(f"frame {frame_idx}: {len(frame)} bytes, expected {len(expected)}")
                return 1
        try:
            reader.read(READ_TIMEOUT_S)
        except RingClosedError:
            return 0
        print("a frame after the last one")
        return 1


def idle_reader(name: str, reader_idx: int) -> int:
    with ShmRingReader(name, reader_idx):
        time.sleep(IDLE_S)
    return 0


def idle_writer(name_file: str) -> int:
    """Create a ring for one reader, publish one frame, tell its name, then wait."""
    ring = ShmRingWriter(1, num_slots=4, slot_bytes=64)
    ring.write(b"first step", READ_TIMEOUT_S)
    Path(name_file).write_text(ring.name)
    time.sleep(IDLE_S)
    ring.close()
    return 0


def main() -> int:
    match sys.argv[1:]:
        case ["checking_reader", name, reader_idx, seed, num_frames]:
            return checking_reader(name, int(reader_idx), int(seed), int(num_frames))
        case ["idle_reader", name, reader_idx]:
            return idle_reader(name, int(reader_idx))
        case ["idle_writer", name_file]:
            return idle_writer(name_file)
    raise SystemExit(f"unknown peer arguments {sys.argv[1:]}")
