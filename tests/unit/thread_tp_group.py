"""TP groups whose ranks are threads of this process, so the unit tests run every rank of a model
with no process and no socket: the all-reduce sums in place, in rank order, behind a barrier."""

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from worker.distributed import TPGroup

BARRIER_TIMEOUT_S = 30.0  # the longest one rank waits for the others at an all-reduce
R = TypeVar("R")


class ThreadTPGroup(TPGroup):
    """One rank of a TP group whose ranks are threads of this process: the all-reduce sums every
    rank's tensor in rank order behind a barrier, so each rank gets the same bytes."""

    def __init__(
        self, rank: int, slots: list[torch.Tensor | None], barrier: threading.Barrier
    ) -> None:
        self.rank, self.tp_size = rank, len(slots)
        self.process_group, self.num_ranks_on_device, self.shm = None, 1, None
        self.slots, self.barrier = slots, barrier

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = tensor.clone()
        self.barrier.wait(BARRIER_TIMEOUT_S)
        total = self.slots[0].clone()
        for part in self.slots[1:]:
            total += part
        self.barrier.wait(BARRIER_TIMEOUT_S)  # nobody overwrites a slot before all have read
        return tensor.copy_(total)

    def check_invariants(self) -> None:
        assert 0 <= self.rank < self.tp_size, f"rank {self.rank} outside [0, {self.tp_size})"


def thread_groups(tp_size: int) -> list[ThreadTPGroup]:
    slots: list[torch.Tensor | None] = [None] * tp_size
    barrier = threading.Barrier(tp_size)
    return [ThreadTPGroup(rank, slots, barrier) for rank in range(tp_size)]


def run_ranks(tp_size: int, work: Callable[[ThreadTPGroup], R]) -> list[R]:
    """Run work(group) on tp_size threads, one per rank; results in rank order; re-raises."""
    groups = thread_groups(tp_size)
    results: list = [None] * tp_size  # each rank's, in rank order
    errors: list[BaseException] = []

    def main(group: ThreadTPGroup) -> None:
        try:
            results[group.rank] = work(group)
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()  # the other ranks stop waiting in their all-reduce

    threads = [threading.Thread(target=main, args=(g,), name=f"rank-{g.rank}") for g in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BARRIER_TIMEOUT_S * 4)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank thread is still running"
    return results
