"""KVTiers: one rank's memory below its device pages (a host tier, optionally a disk tier) and the
copies a step's KVTransfers name (DESIGN.md §3.5). The engine decides every move; this module only
copies, in the order the step gives, and reports the disk slots that hold no valid copy.

On CUDA the copies run on a side stream: it starts after the work already queued (the last forward
wrote the pages it copies out), and the forward waits on one event after the copies, so it neither
overwrites a page before its copy is taken nor reads a page before it is copied in.
"""

import contextlib
import logging
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from protocol.kv_cache_spec import NULL_BLOCK_ID, KVCacheConfig, bytes_per_block
from protocol.worker_messages import KVTransfers
from worker.disk_tier import DiskTier, disk_file_name, remove_stale_files
from worker.kv_cache import shared_kv_tensors

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Pairs:
    """One list of a step's KVTransfers: (source, destination) indexes, as int64 columns."""

    src: np.ndarray  # [n]
    dst: np.ndarray  # [n]

    @staticmethod
    def decode(data: bytes, name: str, num_src: int, num_dst: int, min_dst: int = 0) -> "Pairs":
        if len(data) % 8:
            raise ValueError(f"kv_transfers.{name} holds {len(data)} bytes, expected int32 pairs")
        pairs = np.frombuffer(data, dtype="<i4").astype(np.int64).reshape(-1, 2)
        src, dst = pairs[:, 0], pairs[:, 1]
        if len(src) and not (src.min() >= 0 and src.max() < num_src):
            raise ValueError(f"kv_transfers.{name} reads {src.tolist()}, expected 0 to {num_src}")
        if len(dst) and not (dst.min() >= min_dst and dst.max() < num_dst):
            raise ValueError(
                f"kv_transfers.{name} writes {dst.tolist()}, expected {min_dst} to {num_dst}"
            )
        if len(np.unique(dst)) != len(dst):
            raise ValueError(f"kv_transfers.{name} writes one destination twice: {dst.tolist()}")
        return Pairs(src, dst)

    def runs(self) -> list[tuple[int, int, int]]:
        """(first source, first destination, length) of each stretch where both sides advance by
        one: a stretch is copied with one call per tensor."""
        if not len(self.src):
            return []
        is_break = (np.diff(self.src) != 1) | (np.diff(self.dst) != 1)
        starts = np.concatenate(([0], np.flatnonzero(is_break) + 1))
        lengths = np.diff(np.concatenate((starts, [len(self.src)])))
        return list(
            zip(self.src[starts].tolist(), self.dst[starts].tolist(), lengths.tolist(), strict=True)
        )


class KVTiers:
    """A host tier of `num_host_slots` slots, each one block id's page in every shared KV tensor,
    and an optional DiskTier of slots of the same payload.

    Invariants: `host[t]` is [num_host_slots, page_stride] like device tensor t's rows;
    `is_host_written[s]` is whether host slot s holds a page copied in (from the device or a
    verified disk slot) since the last failure there; a host slot is never copied to the device
    or to disk unless it is written.
    """

    def __init__(
        self, device_pages: list[torch.Tensor], num_host_slots: int, disk: DiskTier | None
    ) -> None:
        if not device_pages:
            raise ValueError("a host tier needs at least one shared KV tensor")
        self.device_pages = device_pages  # per shared tensor: [num_blocks, page_stride] uint8
        self.device = device_pages[0].device
        self.num_blocks, page_stride = device_pages[0].shape
        self.is_cuda = self.device.type == "cuda"
        # [num_tensors, num_host_slots, page_stride]: slot s of tensor t is contiguous, like the
        # device row it mirrors; pinned on CUDA so that copies are asynchronous DMA
        self.host = torch.empty(
            (len(device_pages), num_host_slots, page_stride),
            dtype=torch.uint8,
            pin_memory=self.is_cuda,
        )
        self.host_numpy = self.host.numpy()  # the same memory, for disk I/O
        self.num_host_slots = num_host_slots
        self.is_host_written = np.zeros(num_host_slots, dtype=bool)
        self.disk = disk
        if disk is not None and disk.payload_bytes != self.payload_bytes:
            raise ValueError(
                f"disk slots of {disk.payload_bytes} bytes for pages of {self.payload_bytes} bytes"
            )
        self.side_stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    @property
    def payload_bytes(self) -> int:
        """Bytes of one slot: one page in each shared tensor."""
        return self.host.shape[0] * self.host.shape[2]

    def apply(self, transfers: KVTransfers) -> list[int]:
        """Run one step's copies in field order; the disk slots left without a valid copy."""
        num_disk = self.disk.num_slots if self.disk is not None else 0
        host_to_disk = Pairs.decode(
            transfers.host_to_disk, "host_to_disk", self.num_host_slots, num_disk
        )
        device_to_host = Pairs.decode(
            transfers.device_to_host, "device_to_host", self.num_blocks, self.num_host_slots
        )
        disk_to_host = Pairs.decode(
            transfers.disk_to_host, "disk_to_host", num_disk, self.num_host_slots
        )
        host_to_device = Pairs.decode(
            transfers.host_to_device,
            "host_to_device",
            self.num_host_slots,
            self.num_blocks,
            min_dst=NULL_BLOCK_ID + 1,  # the null block stays zero
        )
        if self.side_stream is not None:  # copy-outs read what the forwards queued so far wrote
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        failed = self._host_to_disk(host_to_disk)
        self._device_to_host(device_to_host)
        failed += self._disk_to_host(disk_to_host)
        self._host_to_device(host_to_device)
        if self.side_stream is not None:  # the forward waits for this step's copies, no more
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        return failed

    def _host_to_disk(self, pairs: Pairs) -> list[int]:
        if not len(pairs.src):
            return []
        assert self.disk is not None, "disk slots were range-checked against a disk tier"
        self._sync_host()
        failed = []
        for host_slot, disk_slot in zip(pairs.src.tolist(), pairs.dst.tolist(), strict=True):
            if not self.is_host_written[host_slot]:
                # emptied by a failed disk read: its block was lost, so its write fails too
                self.disk.forget(disk_slot)
                failed.append(disk_slot)
            elif not self.disk.write(disk_slot, self._host_pieces(host_slot)):
                failed.append(disk_slot)
        return failed

    def _device_to_host(self, pairs: Pairs) -> None:
        with self._on_side_stream():
            for block_id, host_slot, length in pairs.runs():
                for t, pages in enumerate(self.device_pages):
                    self.host[t, host_slot : host_slot + length].copy_(
                        pages[block_id : block_id + length], non_blocking=self.is_cuda
                    )
        self.is_host_written[pairs.dst] = True

    def _disk_to_host(self, pairs: Pairs) -> list[int]:
        if not len(pairs.src):
            return []
        assert self.disk is not None, "disk slots were range-checked against a disk tier"
        self._sync_host()
        failed = []
        for disk_slot, host_slot in zip(pairs.src.tolist(), pairs.dst.tolist(), strict=True):
            is_read = self.disk.read(disk_slot, self._host_pieces(host_slot))
            self.is_host_written[host_slot] = is_read
            if not is_read:
                failed.append(disk_slot)
        return failed

    def _host_to_device(self, pairs: Pairs) -> None:
        if len(pairs.src) and not self.is_host_written[pairs.src].all():
            empty = pairs.src[~self.is_host_written[pairs.src]].tolist()
            # the engine copies in only slots it knows hold a copy: a disk read is copied in
            # once its step reported no failure, so this is a bug, and wrong tokens would follow
            raise ValueError(f"kv_transfers.host_to_device reads empty host slots {empty}")
        with self._on_side_stream():
            for host_slot, block_id, length in pairs.runs():
                for t, pages in enumerate(self.device_pages):
                    pages[block_id : block_id + length].copy_(
                        self.host[t, host_slot : host_slot + length], non_blocking=self.is_cuda
                    )

    def _host_pieces(self, host_slot: int) -> list[np.ndarray]:
        """Host slot `host_slot` as one buffer per shared tensor, for disk I/O."""
        return [self.host_numpy[t, host_slot] for t in range(self.host_numpy.shape[0])]

    def _on_side_stream(self) -> AbstractContextManager[object]:
        """Copies issued inside run on the side stream (on CUDA; the CPU copies at once)."""
        if self.side_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.side_stream)

    def _sync_host(self) -> None:
        """Before the CPU touches host slots: the side stream's copies into and out of them end."""
        if self.side_stream is not None:
            self.side_stream.synchronize()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def check_invariants(self) -> None:
        assert self.host.shape[1] == self.num_host_slots == len(self.is_host_written), (
            f"host tier {tuple(self.host.shape)} for {self.num_host_slots} slots"
        )
        assert all(p.shape == self.device_pages[0].shape for p in self.device_pages), (
            f"shared tensors differ: {[tuple(p.shape) for p in self.device_pages]}"
        )
        if self.disk is not None:
            self.disk.check_invariants()


def build_kv_tiers(
    kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor], tp_size: int, rank: int
) -> KVTiers | None:
    """The tiers the engine's KVCacheConfig gives this rank, logged; None without a host tier."""
    num_host_slots, num_disk_slots = kv_cache_config.num_host_slots, kv_cache_config.num_disk_slots
    if num_host_slots <= 0:
        if num_disk_slots > 0:
            raise ValueError(f"{num_disk_slots} disk slots without a host tier above them")
        return None
    device_pages = shared_kv_tensors(kv_cache_config, kv_caches, tp_size)
    payload_bytes = bytes_per_block(kv_cache_config.kv_cache_groups, tp_size)
    disk = None
    if num_disk_slots > 0:
        if kv_cache_config.disk_dir is None:
            raise ValueError(f"{num_disk_slots} disk slots without a disk_dir")
        if stale := remove_stale_files(kv_cache_config.disk_dir):
            logger.info("removed %d disk tier files of ranks that are gone", len(stale))
        name = disk_file_name(rank, kv_cache_config.generation)
        disk = DiskTier(os.path.join(kv_cache_config.disk_dir, name), num_disk_slots, payload_bytes)
    tiers = KVTiers(device_pages, num_host_slots, disk)
    logger.info(
        "host tier: %d slots of %d bytes (%.1f MiB)%s",
        num_host_slots,
        payload_bytes,
        num_host_slots * payload_bytes / MIB,
        ""
        if disk is None
        else f"; disk tier: {num_disk_slots} slots of {disk.slot_bytes} bytes "
        f"({num_disk_slots * disk.slot_bytes / MIB:.1f} MiB) in {disk.path}",
    )
    return tiers
