"""ShmAllReduce: ranks played by threads over one segment sum exactly, in rank order, call after
call; a peer that exited or never comes fails the call by name instead of hanging."""

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from worker.shm_all_reduce import (
    SLOT_BYTES,
    PeerGoneError,
    ShmAllReduce,
    create_segment,
    is_process_alive,
    unlink_segment,
)

TIMEOUT_S = 10.0


@pytest.fixture
def segment() -> Iterator[str]:
    name = create_segment(3)
    yield name
    unlink_segment(name)


def run_ranks(ranks: list[ShmAllReduce], calls: list[list[torch.Tensor]]) -> list[BaseException]:
    """Rank r all-reduces calls[r][0], calls[r][1], ... in a thread of its own; their errors."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            for tensor in calls[rank]:
                ranks[rank].all_reduce(tensor)
        except BaseException as exc:  # reported to the test, never lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs"
    return errors


def test_three_ranks_sum_every_call_exactly_and_alike(segment: str) -> None:
    pids = [os.getpid()] * 3
    ranks = [ShmAllReduce(segment, rank, pids, TIMEOUT_S) for rank in range(3)]
    generator = torch.Generator().manual_seed(3)
    inputs = [
        [torch.randint(-(2**40), 2**40, (n,), generator=generator) for n in (1, 256, 7, 256, 3)]
        + [torch.rand(5, 4, dtype=torch.float64, generator=generator)]
        for _ in range(3)
    ]
    expected = [sum(inputs[r][c] for r in range(3)) for c in range(len(inputs[0]))]
    outputs = [[tensor.clone() for tensor in per_rank] for per_rank in inputs]
    assert run_ranks(ranks, outputs) == []
    for rank in range(3):
        ranks[rank].check_invariants()
        assert ranks[rank].num_calls == len(expected)
        for got, want in zip(outputs[rank], expected, strict=True):
            # rank order, (x0 + x1) + x2, on every rank: floats agree to the bit as well
            assert torch.equal(got, want)
    for rank in ranks:
        rank.close()


def test_accepts_only_what_every_rank_can_take_through_the_segment(segment: str) -> None:
    shm = ShmAllReduce(segment, 0, [os.getpid()] * 3, TIMEOUT_S)
    assert shm.accepts(torch.zeros(4, dtype=torch.int64))
    assert shm.accepts(torch.zeros(SLOT_BYTES // 8, dtype=torch.float64))
    assert not shm.accepts(torch.zeros(SLOT_BYTES // 8 + 1, dtype=torch.float64))
    assert not shm.accepts(torch.zeros(4, 4, dtype=torch.float64).t())  # not contiguous
    assert not shm.accepts(torch.zeros(4, dtype=torch.bfloat16))
    shm.close()


def test_a_peer_that_exited_fails_the_call_by_name(segment: str) -> None:
    gone = 2**22 + 12_345  # above the default pid_max: no such process
    shm = ShmAllReduce(segment, 0, [os.getpid(), gone, os.getpid()], TIMEOUT_S)
    with pytest.raises(PeerGoneError, match=rf"rank 1 \(pid {gone}\) exited before all-reduce 1"):
        shm.all_reduce(torch.ones(3, dtype=torch.int64))
    shm.close()


def test_a_live_peer_that_never_comes_times_out_by_name(segment: str) -> None:
    shm = ShmAllReduce(segment, 0, [os.getpid()] * 3, timeout_s=0.3)
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not reach all-reduce 1 within"):
        shm.all_reduce(torch.ones(3, dtype=torch.int64))
    shm.close()


def test_a_process_is_alive_only_while_its_pid_names_a_running_process() -> None:
    assert is_process_alive(os.getpid())
    assert not is_process_alive(2**22 + 12_345)  # above the default pid_max
    assert not is_process_alive(0)  # what a rank that could not map the segment reports
