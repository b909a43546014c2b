"""A NIXL READ that outlives its deadline (worker/kv_transfer_nixl.py): the decode rank reports
the pull failed, and the engine then frees the destination blocks for other requests. NIXL
cancels an active transfer when its handle is released, or refuses the release when it cannot;
a READ it could not cancel is waited out before the failure is reported, so it never writes into
blocks that another request holds by then.

The agent here is a stand-in that follows NIXL's documented states (PROC, DONE, ERR) and its
release rule; no UCX worker, socket or process is made.
"""

import msgspec
import pytest
import torch

from protocol import PROTOCOL_VERSION
from protocol.kv_transfer import (
    KVPin,
    KVPullDone,
    KVPullRequest,
    KVTransferLayout,
    KVTransferOrders,
)
from worker import kv_transfer_nixl
from worker.kv_transfer import KVTransferRank
from worker.kv_transfer_nixl import NixlPages, NixlReadError

NUM_BLOCKS, PAGE_BYTES = 8, 16
SECRET = "ab" * 16


class StuckRead:
    """A READ that stays in flight for `num_polls` state checks past its deadline, and cannot be
    cancelled meanwhile (release fails, as NIXL's does for an active transfer it cannot stop)."""

    def __init__(self, num_polls: int) -> None:
        self.num_polls_left = num_polls
        self.is_released = False
        self.released_while_active = False

    # the nixl_agent methods NixlPages.read calls
    def get_xfer_descs(self, descs: list, mem_type: str) -> list:
        return descs

    def initialize_xfer(self, op: str, local: list, remote: list, remote_name: str) -> str:
        return "handle"

    def transfer(self, handle: str) -> str:
        return "PROC"

    def check_xfer_state(self, handle: str) -> str:
        if self.num_polls_left == 0:
            return "DONE"
        self.num_polls_left -= 1
        return "PROC"

    def release_xfer_handle(self, handle: str) -> None:
        if self.num_polls_left > 0:
            self.released_while_active = True
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: the transfer cannot be cancelled")
        self.is_released = True


def pages_with(agent: StuckRead) -> NixlPages:
    """A NixlPages of one tensor, its agent `agent` (the remote one already added)."""
    pages = NixlPages.__new__(NixlPages)
    pages.name = "decode"
    pages.device_pages = [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)]
    pages.page_bytes = [PAGE_BYTES]
    pages.mem_type, pages.device_id = "DRAM", 0
    pages.agent = agent
    pages._remotes = {"prefill"}
    pages.num_reads = pages.num_read_bytes = 0
    return pages


def test_a_read_nixl_cannot_cancel_is_waited_out_before_the_pull_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_transfer_nixl, "POLL_S", 0.0)
    agent = StuckRead(num_polls=50)
    with pytest.raises(NixlReadError, match=r"did not complete within 0\.0 s"):
        pages_with(agent).read("prefill", b"", [4096, 8192], 0, [1, 2], timeout_s=0.0)
    assert agent.num_polls_left == 0  # the READ had ended when the failure was reported
    assert agent.is_released  # and its handle is freed


def test_a_read_that_fails_is_released_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_transfer_nixl, "POLL_S", 0.0)
    agent = StuckRead(num_polls=0)
    agent.check_xfer_state = lambda handle: "ERR"  # type: ignore[method-assign]
    agent.transfer = lambda handle: "ERR"  # type: ignore[method-assign]
    pages = pages_with(agent)
    with pytest.raises(NixlReadError, match="NIXL reported the READ failed"):
        pages.read("prefill", b"", [4096], 0, [3], timeout_s=1.0)
    assert agent.is_released and pages.num_reads == 0


class RegisteredPages:
    """The prefill side of a NixlPages, as KVTransferRank.answer uses it: no agent is made."""

    name, metadata, device_id = "prefill", b"metadata", 0
    num_progressed = 0

    def addresses(self, block_ids: list[int]) -> list[int]:
        return [4096 + block_id * PAGE_BYTES for block_id in block_ids]

    def progress(self) -> None:
        self.num_progressed += 1

    def close(self) -> None:
        """Nothing was registered."""


def test_only_the_reads_own_puller_ends_the_progress_it_needs() -> None:
    """A prefill rank progresses its agent while a READ it authorised is out, until that READ's
    KVPullDone: a KVPullDone under another secret is refused and ends nothing, so it cannot
    stall a READ over a transport that moves only while the target progresses."""
    layout = KVTransferLayout("checksum", 4, "float32", 1, PAGE_BYTES)
    rank = KVTransferRank(
        0, [torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)], layout, nixl=RegisteredPages()
    )
    try:
        rank.apply(KVTransferOrders(pins=[KVPin(3, SECRET, [2, 5])]))
        request = KVPullRequest(PROTOCOL_VERSION, 0, 3, SECRET, 0, [2, 5], layout, via_nixl=True)
        reply = msgspec.msgpack.decode(rank.answer(msgspec.msgpack.encode(request))[0])
        assert reply[1] is True and rank._is_nixl_read_out()
        forged = KVPullDone(PROTOCOL_VERSION, 0, 3, "cd" * 16, 0, [2, 5])
        reply = msgspec.msgpack.decode(rank.answer(msgspec.msgpack.encode(forged))[0])
        assert reply[1] is False and rank._is_nixl_read_out()
        done = msgspec.structs.replace(forged, secret=SECRET)
        reply = msgspec.msgpack.decode(rank.answer(msgspec.msgpack.encode(done))[0])
        assert reply[1] is True and not rank._is_nixl_read_out()
    finally:
        rank.close()
