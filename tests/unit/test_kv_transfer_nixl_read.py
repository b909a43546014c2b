"""A NIXL READ that outlives its deadline (worker/kv_transfer_nixl.py): the decode rank reports
the pull failed, and the engine then frees the destination blocks for other requests. NIXL
cancels an active transfer when its handle is released, or refuses the release when it cannot;
a READ it could not cancel is waited out before the failure is reported, so it never writes into
blocks that another request holds by then.

The agent here is a stand-in that follows NIXL's documented states (PROC, DONE, ERR) and its
release rule; no UCX worker, socket or process is made.
"""

import pytest
import torch

from worker import kv_transfer_nixl
from worker.kv_transfer_nixl import NixlPages, NixlReadError

NUM_BLOCKS, PAGE_BYTES = 8, 16


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
