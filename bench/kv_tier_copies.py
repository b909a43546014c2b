"""Microseconds per block moved between a rank's pages and its tiers, in each direction, through
the rank's own code (worker/kv_tiers.py): device -> host, host -> device, host -> disk, and
disk -> host with the file's pages dropped from the page cache first (cold) and kept (warm).

Pages are shaped as bench/make_checkpoint.py's `bench` checkpoint (8 layers, 4 KV heads of 64,
16-token blocks, float32: 256 KiB a block). Run: `python -m bench.kv_tiers --copies`.
"""

import os
import random
import statistics
import tempfile
import time

import torch

from bench.make_checkpoint import SHAPES
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.worker_messages import KVTransfers
from worker.kv_cache import allocate_kv_caches
from worker.kv_tiers import KVTiers, build_kv_tiers

BLOCK_SIZE = 16
NUM_SLOTS = 256  # of each tier, and device blocks (64 MiB each at the bench shape)
BLOCKS_PER_STEP = 32  # pairs in one list of one step's KVTransfers


def bench_groups() -> list[KVCacheGroupSpec]:
    shape = SHAPES["bench"]
    spec = FullAttentionSpec(BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, "float32")
    return [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(shape.num_layers)], spec)]


def pairs(src: list[int], dst: list[int]) -> bytes:
    return pack_int32(x for pair in zip(src, dst, strict=True) for x in pair)


def drop_page_cache(tiers: KVTiers) -> None:
    """Write the disk tier's dirty pages and drop them, so that the next read goes to the disk."""
    assert tiers.disk is not None and tiers.disk.fd is not None
    os.fsync(tiers.disk.fd)
    os.posix_fadvise(tiers.disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def copy_figures(repeats: int, seed: int = 0) -> dict[str, float]:
    """The median µs per block of each direction over `repeats` steps of BLOCKS_PER_STEP
    scattered blocks each (and contiguous runs for the device copies)."""
    rng = random.Random(seed)
    times_s: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvs-tier-copies-") as folder:
        config = KVCacheConfig(
            NUM_SLOTS + 1,
            bench_groups(),
            num_host_slots=NUM_SLOTS,
            num_disk_slots=NUM_SLOTS,
            disk_dir=folder,
        )
        kv_caches = allocate_kv_caches(config, 1, torch.device("cpu"))
        tiers = build_kv_tiers(config, kv_caches, 1, rank=0)
        assert tiers is not None
        for pages in tiers.device_pages:
            pages[1:] = torch.randint(0, 256, pages[1:].shape, dtype=torch.uint8)
        # every host slot holds a page before anything copies from it
        tiers.apply(KVTransfers(device_to_host=pairs(list(range(1, 257)), list(range(256)))))

        def timed(name: str, transfers: KVTransfers) -> None:
            start = time.perf_counter()
            failed = tiers.apply(transfers)
            times_s.setdefault(name, []).append(time.perf_counter() - start)
            if failed:
                raise RuntimeError(f"{name}: disk slots {failed} failed")

        try:
            for _ in range(repeats):
                blocks = rng.sample(range(1, NUM_SLOTS + 1), BLOCKS_PER_STEP)
                slots = rng.sample(range(NUM_SLOTS), BLOCKS_PER_STEP)
                disk_slots = rng.sample(range(NUM_SLOTS), BLOCKS_PER_STEP)
                first = rng.randrange(1, NUM_SLOTS + 1 - BLOCKS_PER_STEP)
                run = list(range(first, first + BLOCKS_PER_STEP))
                timed("device_to_host", KVTransfers(device_to_host=pairs(blocks, slots)))
                timed("host_to_device", KVTransfers(host_to_device=pairs(slots, blocks)))
                timed("device_to_host_contiguous", KVTransfers(device_to_host=pairs(run, run)))
                timed("host_to_device_contiguous", KVTransfers(host_to_device=pairs(run, run)))
                timed("host_to_disk", KVTransfers(host_to_disk=pairs(slots, disk_slots)))
                drop_page_cache(tiers)
                timed("disk_to_host_cold", KVTransfers(disk_to_host=pairs(disk_slots, slots)))
                timed("disk_to_host_warm", KVTransfers(disk_to_host=pairs(disk_slots, slots)))
        finally:
            tiers.close()
    figures: dict[str, float] = {"block_bytes": float(tiers.payload_bytes)}
    for name, values in times_s.items():
        figures[f"{name}_us_per_block"] = 1e6 * statistics.median(values) / BLOCKS_PER_STEP
    return figures
