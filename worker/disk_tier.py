"""DiskTier: one rank's preallocated file of KV slots, each written with a checksum and verified
on every read (DESIGN.md §3.5). It only copies bytes in and out of the slots the engine names; it
never decides what to keep, and a full or failing disk becomes a failed slot, never an exception.

The checksum is xxHash's XXH3-64 (the `xxhash` package, already a dependency for prefix hashing):
it runs about 29 GB/s on this CPU against 3.9 GB/s for zlib.crc32, so verifying a slot costs far
less than reading it, and its 64 bits make a corrupt slot that passes vanishingly unlikely.
"""

import logging
import os
import socket
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

# Each slot starts with (magic, slot index, XXH3-64 of the payload): the index catches a read or
# write that landed on the wrong slot, the checksum a torn or corrupt one.
SLOT_HEADER = struct.Struct("<4sIQ")
SLOT_MAGIC = b"KVT1"


def disk_file_name(rank: int, generation: int) -> str:
    """One file per rank of one worker generation of one process, so that the ranks of every
    engine on a host (and on hosts sharing the folder) never collide."""
    return f"kvserve-tier-{socket.gethostname()}-pid{os.getpid()}-rank{rank}-gen{generation}.kv"


def remove_stale_files(disk_dir: str) -> list[str]:
    """Remove the files of this host's ranks that died without closing (SIGKILL, a crash): a file
    whose process is gone is never read again. Returns the names removed."""
    prefix = f"kvserve-tier-{socket.gethostname()}-pid"
    removed = []
    for name in os.listdir(disk_dir):
        if not (name.startswith(prefix) and name.endswith(".kv")):
            continue
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or _is_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(disk_dir, name))
            removed.append(name)
        except FileNotFoundError:
            continue  # another rank of this host removed it first
    return removed


def _is_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (killed, not yet reaped by its launcher) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return True  # no /proc to ask: kill() says it exists
    return text[text.rindex(")") + 2 :].split()[0] != "Z"


def payload_checksum(pieces: Sequence[np.ndarray]) -> int:
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    return hasher.intdigest()


class DiskTier:
    """`num_slots` slots of `payload_bytes` (one block id's pages in every shared KV tensor) in one
    preallocated file, each behind a SLOT_HEADER.

    Invariants: `checksums[slot]` is the checksum of the last write to `slot` that succeeded, or
    None when the slot holds nothing valid (never written, or its last write failed); a read
    succeeds only when the header on disk names the slot and matches both it and the payload.
    Once the file cannot be created, the tier is broken: every write and read fails.
    """

    def __init__(self, path: str, num_slots: int, payload_bytes: int) -> None:
        self.path = path
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self.slot_bytes = SLOT_HEADER.size + payload_bytes
        self.checksums: list[int | None] = [None] * num_slots
        self.num_failed_writes = 0
        self.num_failed_reads = 0
        self.fd: int | None = None
        self.is_created = False  # only a file this tier created is removed by close()
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.is_created = True
            # reserve every block now: a disk that fills later cannot fail a write midway
            os.posix_fallocate(self.fd, 0, num_slots * self.slot_bytes)
        except OSError as exc:
            logger.warning(
                "disk tier %s cannot hold %d slots of %d bytes (%s): every disk copy will fail "
                "and be recomputed",
                path,
                num_slots,
                self.slot_bytes,
                exc,
            )
            self.close()

    @property
    def is_broken(self) -> bool:
        return self.fd is None

    def write(self, slot: int, pieces: Sequence[np.ndarray]) -> bool:
        """Write one slot's payload (its pieces back to back) behind its header; False when the
        write failed, which leaves the slot empty."""
        self.checksums[slot] = None  # from here until the write completes, nothing valid is there
        if self.fd is None:
            self.num_failed_writes += 1
            return False
        checksum = payload_checksum(pieces)
        header = SLOT_HEADER.pack(SLOT_MAGIC, slot, checksum)
        try:
            written = os.pwritev(self.fd, [header, *pieces], slot * self.slot_bytes)
        except OSError as exc:
            logger.warning("disk tier %s: writing slot %d failed: %s", self.path, slot, exc)
            written = -1
        if written != self.slot_bytes:
            self.num_failed_writes += 1
            return False
        self.checksums[slot] = checksum
        return True

    def forget(self, slot: int) -> None:
        """Leave `slot` empty: what it was to receive was lost above it (a failed write)."""
        self.checksums[slot] = None
        self.num_failed_writes += 1

    def read(self, slot: int, pieces: Sequence[np.ndarray]) -> bool:
        """Read one slot into `pieces` (writable, payload_bytes in all) and verify it; False when
        the slot is empty, the read failed or the checksum does not match."""
        expected = self.checksums[slot]
        if self.fd is None or expected is None:
            self.num_failed_reads += 1
            return False
        header = bytearray(SLOT_HEADER.size)
        try:
            num_read = os.preadv(self.fd, [header, *pieces], slot * self.slot_bytes)
        except OSError as exc:
            logger.warning("disk tier %s: reading slot %d failed: %s", self.path, slot, exc)
            num_read = -1
        if num_read == self.slot_bytes:
            magic, header_slot, checksum = SLOT_HEADER.unpack(header)
            if (
                magic == SLOT_MAGIC
                and header_slot == slot
                and checksum == expected
                and payload_checksum(pieces) == expected
            ):
                return True
        logger.warning("disk tier %s: slot %d failed its checksum or read: a miss", self.path, slot)
        self.num_failed_reads += 1
        return False

    def close(self) -> None:
        """Close and remove the file: nothing in it outlives this rank's generation."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.is_created:
            self.is_created = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                logger.warning("disk tier %s was removed by someone else", self.path)

    def check_invariants(self) -> None:
        assert len(self.checksums) == self.num_slots, (
            f"{len(self.checksums)} checksums for {self.num_slots} slots"
        )
        if self.fd is None:
            assert all(c is None for c in self.checksums), "a broken disk tier holds a valid slot"
