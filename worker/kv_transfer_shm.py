"""Same-host KV transfer pages through shared memory (DESIGN.md §12): a prefill rank answers a pull
over ipc:// by writing the pages into a fresh file under /dev/shm and naming it in its reply; the
decode rank maps it, copies the pages into its blocks and removes it. The pages then cross once
through memory instead of through the socket.

A segment is 0600, named with a random part, and holds one run of pages per shared KV tensor, in
tensor order. The puller removes it once read; the server removes any it made that is still there
after SHM_GRACE_S (a puller that timed out or died), and all of them when it closes.
"""

import contextlib
import logging
import mmap
import os
import secrets
import time

import numpy as np

logger = logging.getLogger(__name__)

SHM_FOLDER = "/dev/shm"
SHM_GRACE_S = 30.0  # well past any puller's wait for its reply


class ShmPages:
    """The segments one transfer server made and has not seen removed.

    Invariants: `made` maps each segment name this server created to its creation time
    (time.monotonic()); a name leaves when it is found removed, or when this server removes it.
    """

    def __init__(self, rank: int) -> None:
        self.prefix = f"kvserve-kv-transfer-{os.getpid()}-rank{rank}-"
        self.made: dict[str, float] = {}
        self.num_made = 0  # segments made since start

    def put(self, pages: list[np.ndarray]) -> str:
        """A new segment holding `pages` (uint8 arrays) one after the other; its name."""
        self.sweep()
        name = self.prefix + secrets.token_hex(8)
        path = os.path.join(SHM_FOLDER, name)
        total = sum(page.nbytes for page in pages)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(total, 1))
            with mmap.mmap(fd, max(total, 1)) as segment:
                for page in pages:  # one after the other, from the start
                    segment.write(np.ascontiguousarray(page).data)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.made[name] = time.monotonic()
        self.num_made += 1
        return name

    def sweep(self) -> None:
        """Forget segments their pullers removed; remove those older than SHM_GRACE_S."""
        now = time.monotonic()
        for name, made_s in list(self.made.items()):
            path = os.path.join(SHM_FOLDER, name)
            if not os.path.exists(path):
                del self.made[name]
            elif now - made_s > SHM_GRACE_S:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                del self.made[name]

    def close(self) -> None:
        for name in self.made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_FOLDER, name))
        self.made.clear()


def read_pages(name: str, num_bytes: int) -> bytes:
    """The first `num_bytes` of the segment `name`, which is then removed (ValueError when it is
    not a transfer's segment, is gone, or is short)."""
    if "/" in name or not name.startswith("kvserve-kv-transfer-"):
        raise ValueError(f"shared memory segment {name!r} is not a transfer's")
    path = os.path.join(SHM_FOLDER, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ValueError(f"shared memory segment {name} is gone") from None
    try:
        size = os.fstat(fd).st_size
        if size < num_bytes:
            raise ValueError(f"segment {name} holds {size} bytes, expected {num_bytes}")
        with mmap.mmap(fd, max(num_bytes, 1), prot=mmap.PROT_READ) as segment:
            return segment[:num_bytes]
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
