"""ReplyQueue: a rank's step replies, each held until its model output is ready, sent in step
order, so that the rank takes and runs the next step while a device-like model (fixed-time) still
computes this one, as a GPU rank's host builds the next batch. Never reorders replies.
"""

import time
from collections import deque

# zmq's poll counts whole milliseconds: a wait shorter than this is slept out instead
POLL_RESOLUTION_S = 0.001


class ReplyQueue:
    """Encoded replies with their ready times (time.perf_counter()), oldest step first.

    Invariants: the replies stay in the order they were put. The engine keeps at most two steps
    in flight, so at most two are held.
    """

    def __init__(self) -> None:
        self._held: deque[tuple[float, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, ready_at_s: float, frame: bytes) -> None:
        self._held.append((ready_at_s, frame))

    def next_ready_at(self) -> float | None:
        """When the oldest held reply is ready; None when none is held."""
        return self._held[0][0] if self._held else None

    def pop_due(self, now_s: float) -> list[bytes]:
        """The replies ready by `now_s`, in order, stopping at the first one that is not."""
        due = []
        while self._held and self._held[0][0] <= now_s:
            due.append(self._held.popleft()[1])
        return due

    def drop(self) -> int:
        """Forget every held reply (the engine stopped this rank); how many there were."""
        count = len(self._held)
        self._held.clear()
        return count


def sleep_until(deadline_s: float) -> None:
    """Sleep until time.perf_counter() reaches deadline_s; at once if it already has."""
    while (remaining_s := deadline_s - time.perf_counter()) > 0:
        time.sleep(remaining_s)
