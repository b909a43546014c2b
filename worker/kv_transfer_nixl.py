"""KV transfer pages through NIXL (DESIGN.md §12), the library vLLM's NixlConnector and NVIDIA
Dynamo move KV with: a decode rank READs the pinned pages straight out of the prefill rank's
registered KV tensors into its own blocks (UCX: RDMA between hosts, shared memory or CUDA IPC on
one), with no copy through the prefill rank's host.

NIXL is optional (the `nixl` extra): `nixl_available()` says whether it imports, and without it
the built-in transports serve (worker/kv_transfer.py). The ZeroMQ control channel stays: a pull
is still a `KVPullRequest` with the handle's transfer id, secret and block ids, which the prefill
rank checks as before. Only then does it answer with where those blocks' pages lie (one address
per shared KV tensor and block) and its agent's metadata; the decode rank READs them, then sends
a `KVPullDone` that the prefill rank answers ok only while the transfer is still pinned. An unpin
is applied before the forward of the first step that could reuse the blocks, so a pin that holds
after the READ ended means the pages read were the request's: the pull completes only then.
A READ past its deadline is cancelled before the pull is reported failed (the engine then frees
its destination blocks); one NIXL cannot cancel is waited out first, so it never writes into
blocks another request holds.

What the secret guards under NIXL: which descriptors an honest puller is given, and whether
its READ counts. It cannot bound what a peer that was answered once READs: the agent's metadata
and the addresses let it READ any page of the registered tensors, after the unpin and of other
requests, for the agent's life (as with any RDMA registration), and UCX moves the pages
unencrypted. So a prefill engine serves NIXL only where its control channel admits the
deployment's decode ranks alone, under CURVE or over its private ipc folder
(engine_core/kv_transfer/layout.describe_unauthenticated_nixl): those peers, and the fabric
between them, are trusted with every page.

Each NixlPages registers its rank's KV tensors once, when the rank builds its transfer agent. It
runs no progress thread (NIXL's spins a core without pause): the puller progresses its side as it
polls its READ, and the prefill rank's serving thread progresses its agent every NIXL_PROGRESS_MS
while READs it authorised are out (until their KVPullDone, or PULL_TIMEOUT_S), and at each of its
polls (SERVE_POLL_MS) otherwise, so that a READ past its authorisation still ends.
"""

import logging
import secrets
import time

import torch

logger = logging.getLogger(__name__)

POLL_S = 0.0005  # between checks of a READ in flight: a page run moves in well under a step
BACKEND = "UCX"
STUCK_READ_LOG_S = 5.0  # how often a READ that could not be cancelled is logged while it runs


def nixl_available() -> bool:
    """Whether NIXL's Python API imports here (it is an optional dependency)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


class NixlReadError(RuntimeError):
    """A READ that did not complete by its deadline, or that NIXL reported failed."""


class NixlPages:
    """One rank's NIXL agent, with its KV tensors registered.

    Invariants: `device_pages` are registered with the agent for its whole life; `_remotes`
    names the remote agents added (by their metadata's name), used on the puller thread only.
    """

    def __init__(self, rank: int, device_pages: list[torch.Tensor]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # NIXL logs through a stdout handler of its own at INFO: keep it to this process's level
        logging.getLogger("nixl").setLevel(max(logger.getEffectiveLevel(), logging.INFO))
        self.name = f"kvserve-rank{rank}-{secrets.token_hex(6)}"
        self.device_pages = device_pages  # per shared tensor: [num_blocks, page_bytes] uint8
        self.page_bytes = [pages.shape[1] for pages in device_pages]
        device = device_pages[0].device if device_pages else torch.device("cpu")
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        # No progress thread: NIXL's spins a core per agent without pause. The puller's state
        # checks progress its side, and the server calls progress() while READs are out.
        config = nixl_agent_config(enable_prog_thread=False, backends=[BACKEND])
        self.agent = nixl_agent(self.name, config)
        regions = [(pages.data_ptr(), pages.nbytes, self.device_id, "") for pages in device_pages]
        self._registered = self.agent.register_memory(regions, self.mem_type)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self._remotes: set[str] = set()
        self.num_reads = 0  # READs completed
        self.num_read_bytes = 0

    # -- the prefill side ----------------------------------------------------------------------

    def addresses(self, block_ids: list[int]) -> list[int]:
        """Where the pages of `block_ids` lie: tensor after tensor, block after block."""
        return [
            pages.data_ptr() + block_id * page_bytes
            for pages, page_bytes in zip(self.device_pages, self.page_bytes, strict=True)
            for block_id in block_ids
        ]

    def progress(self) -> None:
        """Let the backend move what peers READ from this agent (UCX over tcp, or shared memory
        between processes, needs the target's progress); the serving thread's alone."""
        self.agent.get_new_notifs()

    # -- the decode side -----------------------------------------------------------------------

    def read(
        self,
        remote_name: str,
        remote_metadata: bytes,
        remote_addresses: list[int],
        remote_device_id: int,
        dst_block_ids: list[int],
        timeout_s: float,
    ) -> int:
        """READ the remote pages at `remote_addresses` (as `addresses` lists them) into
        `dst_block_ids`; the bytes moved, or NixlReadError. The puller thread's alone."""
        num_blocks = len(dst_block_ids)
        if len(remote_addresses) != num_blocks * len(self.device_pages):
            raise NixlReadError(
                f"{len(remote_addresses)} remote pages for {num_blocks} blocks of "
                f"{len(self.device_pages)} tensors"
            )
        agent = self.agent
        if remote_name not in self._remotes:
            added = agent.add_remote_agent(remote_metadata)
            if isinstance(added, bytes):  # NIXL's binding answers bytes
                added = added.decode(errors="replace")
            if added != remote_name:
                raise NixlReadError(f"the metadata names agent {added!r}, not {remote_name!r}")
            self._remotes.add(remote_name)
        sizes = [size for size in self.page_bytes for _ in range(num_blocks)]
        local = [
            (address, size, self.device_id)
            for address, size in zip(self.addresses(dst_block_ids), sizes, strict=True)
        ]
        remote = [
            (address, size, remote_device_id)
            for address, size in zip(remote_addresses, sizes, strict=True)
        ]
        local_descs = agent.get_xfer_descs(local, self.mem_type)
        remote_descs = agent.get_xfer_descs(remote, self.mem_type)
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote_name)
        deadline = time.monotonic() + timeout_s
        try:
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR") and time.monotonic() <= deadline:
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
        except BaseException:
            self._release(handle)
            raise
        self._release(handle)
        if state == "ERR":
            raise NixlReadError("NIXL reported the READ failed")
        if state != "DONE":
            raise NixlReadError(f"the READ did not complete within {timeout_s} s")
        num_bytes = sum(sizes)
        self.num_reads += 1
        self.num_read_bytes += num_bytes
        return num_bytes

    def _release(self, handle: object) -> None:
        """Release a READ's handle, which cancels it if it is still active. One NIXL cannot
        cancel (it refuses the release) may still write into the destination blocks, which the
        engine frees for other requests once the pull is reported failed: it is waited out
        (progressing it) until it ends, however long the peer takes, then released."""
        agent = self.agent
        try:
            agent.release_xfer_handle(handle)
            return
        except Exception as exc:  # NIXL's own errors carry no common base class
            logger.warning("a NIXL READ could not be cancelled (%s): waiting for it to end", exc)
        waited_s, next_log_s = 0.0, STUCK_READ_LOG_S
        while agent.check_xfer_state(handle) not in ("DONE", "ERR"):
            time.sleep(POLL_S)
            waited_s += POLL_S
            if waited_s >= next_log_s:
                logger.warning("a NIXL READ still runs %.0f s past its deadline", waited_s)
                next_log_s += STUCK_READ_LOG_S
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:  # it ended: nothing writes the blocks any more
            logger.info("could not release an ended NIXL READ: %s", exc)

    def forget(self, remote_name: str) -> None:
        """Drop a remote agent (its rank is gone, or answered wrongly): re-added if met again."""
        if remote_name in self._remotes:
            self._remotes.discard(remote_name)
            try:
                self.agent.remove_remote_agent(remote_name)
            except Exception as exc:  # NIXL's own errors carry no common base class
                logger.info("could not remove NIXL agent %s: %s", remote_name, exc)

    def close(self) -> None:
        for remote_name in list(self._remotes):
            self.forget(remote_name)
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:  # as above
            logger.info("could not deregister the KV tensors from NIXL: %s", exc)
