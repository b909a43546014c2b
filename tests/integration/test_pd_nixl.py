"""P/D pages through NIXL between two real processes, on CPU memory (UCX): a prefill rank in a
child process serves pulls over ipc with its KV tensors registered in a NIXL agent; the decode
rank here READs them into its own registered tensors.

The pulled pages equal the served ones and came by a READ (no /dev/shm segment); a pull with
another secret or blocks outside the pin is refused before any descriptor leaves the prefill
rank and reads nothing; a transfer unpinned while its READ ran fails the pull (the prefill rank
refuses the KVPullDone); a pair where one side lacks NIXL moves the pages the built-in way.
Skipped only where NIXL is not installed.
"""

import multiprocessing
import time
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is not installed (the nixl extra)")

from protocol.kv_transfer import (
    KVPin,
    KVPull,
    KVPullDone,
    KVTransferLayout,
    KVTransferOrders,
)
from worker import kv_transfer
from worker.kv_transfer import KVTransferRank
from worker.kv_transfer_nixl import NixlPages, NixlReadError

pytestmark = pytest.mark.integration

NUM_BLOCKS, PAGE_BYTES, NUM_TENSORS = 16, 64, 2
LAYOUT = KVTransferLayout("checksum", 4, "float32", 1, PAGE_BYTES * NUM_TENSORS)
SECRET = "ab" * 16
CHILD_TIMEOUT_S = 60.0


def pages(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.uint8, generator=generator)
        for _ in range(NUM_TENSORS)
    ]


def serve_pages(folder: str, use_nixl: bool, orders: multiprocessing.Queue, answers) -> None:
    """The prefill rank's process: serve pages(1) at an ipc endpoint under `folder`, apply the
    orders it is sent ("pin", "unpin", "stats", "stop") and answer each."""
    served = pages(1)
    nixl = NixlPages(0, served) if use_nixl else None
    rank = KVTransferRank(0, served, LAYOUT, nixl=nixl)
    try:
        answers.put(rank.serve(f"ipc://{folder}", generation=1))
        while True:
            kind, arg = orders.get(timeout=CHILD_TIMEOUT_S)
            if kind == "pin":
                rank.apply(KVTransferOrders(pins=[KVPin(arg[0], SECRET, arg[1])]))
            elif kind == "unpin":
                rank.apply(KVTransferOrders(unpins=[arg]))
            elif kind == "stop":
                answers.put("stopped")
                return
            answers.put((rank.num_served, rank.num_refused, rank._shm.num_made))
    finally:
        rank.close()


class PrefillProcess:
    def __init__(self, folder: Path, use_nixl: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.orders, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=serve_pages, args=(str(folder), use_nixl, self.orders, self.answers)
        )
        self.process.start()
        self.endpoint: str = self.answers.get(timeout=CHILD_TIMEOUT_S)

    def order(self, kind: str, arg: object = None) -> tuple[int, int, int]:
        """(pulls served, refused, /dev/shm segments made) once the order is applied."""
        self.orders.put((kind, arg))
        return self.answers.get(timeout=CHILD_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.is_alive():
            self.orders.put(("stop", None))
            self.process.join(CHILD_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class UnpinningRank(KVTransferRank):
    """A decode rank that has the prefill rank unpin the transfer between its READ and its
    KVPullDone: as if the prefill engine's deadline passed while the READ ran."""

    prefill: PrefillProcess | None = None

    def exchange(self, endpoint: str, frame: bytes) -> list[bytes]:
        if self.prefill is not None and _is_done(frame):
            self.prefill.order("unpin", 1)
        return super().exchange(endpoint, frame)


def _is_done(frame: bytes) -> bool:
    try:
        msgspec.msgpack.decode(frame, type=KVPullDone)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


def pull_of(endpoint: str, transfer_id: int, first: int, src: list[int], dst: list[int]) -> KVPull:
    return KVPull(0, transfer_id, SECRET, [endpoint], first, src, dst, LAYOUT)


def run_pulls(rank: KVTransferRank, pulls: list[KVPull]) -> tuple[list[int], int]:
    """Order the pulls as a step would and wait for each to be reported: failed ids, bytes."""
    numbered = [msgspec.structs.replace(pull, pull_id=idx + 1) for idx, pull in enumerate(pulls)]
    rank.apply(KVTransferOrders(pulls=numbered))
    finished: list[int] = []
    failed: list[int] = []
    num_bytes = 0
    deadline = time.monotonic() + 30
    while len(finished) < len(pulls):
        assert time.monotonic() < deadline, f"pulls {finished} of {len(pulls)} reported"
        done, done_failed, done_bytes = rank.take_finished()
        finished, failed, num_bytes = finished + done, failed + done_failed, num_bytes + done_bytes
        time.sleep(0.01)
    return sorted(failed), num_bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ucx_tls", [None, "tcp"], ids=["ucx-default", "ucx-tcp"])
def test_a_decode_rank_reads_pinned_pages_through_nixl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ucx_tls: str | None
) -> None:
    """UCX's own choice of transport (shared memory here), and tcp, where the READ moves only
    while the prefill rank progresses its agent (it runs no progress thread)."""
    if ucx_tls is not None:  # both processes' agents: the child inherits it
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    monkeypatch.setattr(kv_transfer, "PULL_TIMEOUT_S", 10.0)
    prefill = PrefillProcess(tmp_path, use_nixl=True)
    pulled = pages(2)
    rank = UnpinningRank(0, pulled, LAYOUT, nixl=NixlPages(0, pulled))
    served = pages(1)  # what the child serves
    try:
        prefill.order("pin", (1, [3, 7, 5, 9]))
        failed, num_bytes = run_pulls(rank, [pull_of(prefill.endpoint, 1, 1, [7, 5], [2, 4])])
        assert failed == [] and num_bytes == 2 * PAGE_BYTES * NUM_TENSORS
        for want, got in zip(served, pulled, strict=True):
            assert torch.equal(got[[2, 4]], want[[7, 5]])
        num_served, num_refused, num_segments = prefill.order("stats")
        assert (num_served, num_refused, num_segments) == (1, 0, 0)  # a READ, no segment
        assert rank.nixl is not None and rank.nixl.num_reads == 1

        # refused before any descriptor leaves the prefill rank: nothing is read
        before = [tensor.clone() for tensor in pulled]
        forged = msgspec.structs.replace(
            pull_of(prefill.endpoint, 1, 0, [3], [6]), secret="cd" * 16
        )
        outside = pull_of(prefill.endpoint, 1, 3, [9, 10], [6, 8])
        failed, _ = run_pulls(rank, [forged, outside])
        assert failed == [1, 2] and rank.nixl.num_reads == 1
        assert prefill.order("stats")[1] == 2
        assert all(torch.equal(a, b) for a, b in zip(before, pulled, strict=True))

        # unpinned while the READ ran: the pull fails, whatever the READ brought
        rank.prefill = prefill
        failed, _ = run_pulls(rank, [pull_of(prefill.endpoint, 1, 0, [3], [6])])
        assert failed == [1] and rank.nixl.num_reads == 2
        assert prefill.order("stats")[1] == 3  # the KVPullDone, refused
    finally:
        rank.close()
        prefill.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nixl_side", ["decode", "prefill"])
def test_a_pair_where_one_side_lacks_nixl_moves_pages_the_builtin_way(
    tmp_path: Path, nixl_side: str
) -> None:
    prefill = PrefillProcess(tmp_path, use_nixl=nixl_side == "prefill")
    pulled = pages(2)
    nixl = NixlPages(0, pulled) if nixl_side == "decode" else None
    rank = KVTransferRank(0, pulled, LAYOUT, nixl=nixl)
    try:
        prefill.order("pin", (4, [2, 6, 8]))
        failed, _ = run_pulls(rank, [pull_of(prefill.endpoint, 4, 0, [2, 6, 8], [1, 3, 5])])
        assert failed == []
        for want, got in zip(pages(1), pulled, strict=True):
            assert torch.equal(got[[1, 3, 5]], want[[2, 6, 8]])
        assert prefill.order("stats") == (1, 0, 1)  # through a /dev/shm segment
        assert nixl is None or nixl.num_reads == 0
    finally:
        rank.close()
        prefill.stop()


class UnreachableNixl(NixlPages):
    """A NIXL agent whose READs fail, as where UCX cannot reach the prefill host."""

    def read(self, *args: object, **kwargs: object) -> int:
        raise NixlReadError("no route to the remote agent")


@pytest.mark.timeout(120)
def test_a_failed_nixl_read_costs_one_pull_then_pages_move_the_builtin_way(
    tmp_path: Path,
) -> None:
    prefill = PrefillProcess(tmp_path, use_nixl=True)
    pulled = pages(2)
    rank = KVTransferRank(0, pulled, LAYOUT, nixl=UnreachableNixl(0, pulled))
    try:
        prefill.order("pin", (2, [5, 6, 7]))
        failed, _ = run_pulls(rank, [pull_of(prefill.endpoint, 2, 0, [5, 6], [3, 4])])
        assert failed == [1]
        failed, _ = run_pulls(rank, [pull_of(prefill.endpoint, 2, 0, [5, 6], [3, 4])])
        assert failed == []
        for want, got in zip(pages(1), pulled, strict=True):
            assert torch.equal(got[[3, 4]], want[[5, 6]])
        assert prefill.order("stats") == (2, 0, 1)  # the second through a /dev/shm segment
    finally:
        rank.close()
        prefill.stop()
