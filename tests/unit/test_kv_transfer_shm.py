"""Same-host transfer pages through /dev/shm: a segment holds the runs it was given and is gone
once read; one nobody reads is removed after the grace period or when its server closes; a name
that is not a transfer's segment is never opened."""

import os

import numpy as np
import pytest

from worker import kv_transfer_shm
from worker.kv_transfer_shm import SHM_FOLDER, ShmPages, read_pages


def test_a_segment_holds_its_pages_and_is_gone_once_read() -> None:
    shm = ShmPages(rank=3)
    pages = [np.arange(16, dtype=np.uint8), np.full(8, 7, dtype=np.uint8)]
    name = shm.put(pages)
    path = os.path.join(SHM_FOLDER, name)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert read_pages(name, 24) == bytes(range(16)) + bytes([7] * 8)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="is gone"):
        read_pages(name, 24)
    shm.sweep()
    assert not shm.made


def test_unread_segments_leave_after_the_grace_period_or_at_close() -> None:
    shm = ShmPages(rank=0)
    kept, stale = shm.put([np.zeros(4, np.uint8)]), shm.put([np.zeros(4, np.uint8)])
    shm.made[stale] -= kv_transfer_shm.SHM_GRACE_S + 1
    shm.sweep()
    assert list(shm.made) == [kept] and not os.path.exists(os.path.join(SHM_FOLDER, stale))
    shm.close()
    assert not shm.made and not os.path.exists(os.path.join(SHM_FOLDER, kept))


@pytest.mark.parametrize("name", ["../etc/passwd", "other-segment", "kvserve-kv-transfer-/x"])
def test_a_name_that_is_not_a_transfer_segment_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a transfer's"):
        read_pages(name, 1)


def test_a_short_segment_is_refused_and_removed() -> None:
    shm = ShmPages(rank=1)
    name = shm.put([np.zeros(4, np.uint8)])
    with pytest.raises(ValueError, match="holds 4 bytes, expected 8"):
        read_pages(name, 8)
    assert not os.path.exists(os.path.join(SHM_FOLDER, name))
