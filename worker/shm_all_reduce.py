"""ShmAllReduce: the all-reduce of CPU ranks that share a host, through one shared-memory segment.

Gloo sends even a 2 KB all-reduce through TCP and its own threads (about 0.7 ms on an idle 2-core
host, far more under load); here each rank copies its tensor into its slot, publishes a sequence
number, waits for every peer's, and sums the slots in rank order. It never outlives its group.
"""

import contextlib
import mmap
import os
import time
import uuid

import numpy as np
import torch

from protocol.shm_ring import LINE_BYTES, MemoryFence

SHM_FOLDER = "/dev/shm"
NAME_PREFIX = "kvserve-tp-"  # the segment is unlinked once every rank has mapped it
SLOT_BYTES = 4 << 20  # a larger tensor goes through the process group instead
NUM_BUFFERS = 2  # call k uses buffer k % 2: a rank can be one call ahead of its slowest peer
SPIN_YIELDS = 32  # sched_yield()s before the wait starts sleeping
SLEEP_S = (20e-6, 200e-6)  # the first sleep and the longest; each doubles the one before
LIVENESS_CHECK_S = 0.1  # how often a waiting rank looks whether its peers still live
DTYPES = (torch.int64, torch.float64, torch.float32, torch.int32)


class PeerGoneError(RuntimeError):
    """A peer exited while this rank waited for it in an all-reduce."""


def create_segment(tp_size: int) -> str:
    """Rank 0: a new, zeroed segment for `tp_size` ranks; its name."""
    name = f"{NAME_PREFIX}{uuid.uuid4().hex}"
    fd = os.open(os.path.join(SHM_FOLDER, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(tp_size))
    finally:
        os.close(fd)
    return name


def unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_FOLDER, name))


def segment_bytes(tp_size: int) -> int:
    """A cache line of sequence number per rank, then NUM_BUFFERS x tp_size slots."""
    return tp_size * LINE_BYTES + NUM_BUFFERS * tp_size * SLOT_BYTES


class ShmAllReduce:
    """One rank's view of the group's segment.

    Invariants: `num_calls` all-reduces went through the segment; this rank's published sequence
    number equals it; every peer's is num_calls - 1, num_calls or num_calls + 1.
    """

    def __init__(self, name: str, rank: int, peer_pids: list[int], timeout_s: float) -> None:
        self.rank, self.tp_size, self.peer_pids = rank, len(peer_pids), peer_pids
        self.timeout_s = timeout_s
        fd = os.open(os.path.join(SHM_FOLDER, name), os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, segment_bytes(self.tp_size))
        finally:
            os.close(fd)
        words_per_line = LINE_BYTES // 8
        header = np.frombuffer(self._mmap, np.int64, self.tp_size * words_per_line)
        self._seq = header[::words_per_line]  # one cache line per rank: no false sharing
        self._fence = MemoryFence()
        self.num_calls = 0

    def check_invariants(self) -> None:
        seq = self._seq.tolist()
        assert seq[self.rank] == self.num_calls, f"published {seq[self.rank]}, {self.num_calls}"
        assert all(abs(s - self.num_calls) <= 1 for s in seq), f"sequence numbers {seq}"

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` can go through the segment; the same answer on every rank."""
        return (
            tensor.device.type == "cpu"
            and tensor.dtype in DTYPES
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() <= SLOT_BYTES
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place, in rank order, so every rank gets the same bits."""
        values = tensor.numpy().reshape(-1)
        call = self.num_calls + 1
        slots = [self._slot(call, rank, values) for rank in range(self.tp_size)]
        slots[self.rank][:] = values
        self._fence()  # the slot's bytes before the number that exposes them
        self._seq[self.rank] = call
        self.num_calls = call
        self._wait_for_peers(call)
        self._fence()  # every peer's number before its slot's bytes
        np.copyto(values, slots[0])
        for slot in slots[1:]:
            np.add(values, slot, out=values)
        return tensor

    def _slot(self, call: int, rank: int, like: np.ndarray) -> np.ndarray:
        slot_idx = (call % NUM_BUFFERS) * self.tp_size + rank
        offset = self.tp_size * LINE_BYTES + slot_idx * SLOT_BYTES
        return np.frombuffer(self._mmap, like.dtype, like.size, offset)

    def _wait_for_peers(self, call: int) -> None:
        """Until every rank published `call`: yield, then sleep, checking liveness and deadline."""
        seq = self._seq
        for _ in range(SPIN_YIELDS):
            if seq.min() >= call:
                return
            os.sched_yield()
        start = time.monotonic()
        next_check, sleep_s = start + LIVENESS_CHECK_S, SLEEP_S[0]
        while seq.min() < call:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, SLEEP_S[1])
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_CHECK_S
                self._check_peers(call, now - start)

    def _check_peers(self, call: int, waited_s: float) -> None:
        late = [rank for rank in range(self.tp_size) if self._seq[rank] < call]
        for rank in late:
            if not is_process_alive(self.peer_pids[rank]):
                raise PeerGoneError(
                    f"rank {rank} (pid {self.peer_pids[rank]}) exited before all-reduce {call}"
                )
        if waited_s >= self.timeout_s:
            raise TimeoutError(
                f"ranks {late} did not reach all-reduce {call} within {self.timeout_s} s"
            )

    def close(self) -> None:
        self._seq = np.zeros(0, np.int64)  # drops the view, so the map can close
        # a step thread may still wait inside a call (its peer frozen) and hold views of the
        # map: then it goes with the process
        with contextlib.suppress(BufferError):
            self._mmap.close()


def is_process_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")
