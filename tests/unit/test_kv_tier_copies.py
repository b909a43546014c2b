"""A rank's tiers below its pages (worker/kv_tiers.py, worker/disk_tier.py) fed hand-written
KVTransfers: exact page bytes both ways, the order within one step, and disk slots that fail."""

import errno
import os
from pathlib import Path

import pytest
import torch

from protocol.buffers import pack_int32, unpack_int32
from protocol.kv_cache_spec import KVCacheConfig, bytes_per_block
from protocol.sampling import SamplingParams
from protocol.worker_messages import (
    CachedRequestData,
    KVTransfers,
    NewRequestData,
    SchedulerOutput,
)
from tests.conftest import worker_test_device
from worker.disk_tier import SLOT_HEADER, disk_file_name, remove_stale_files
from worker.distributed import single_rank_group
from worker.kv_cache import allocate_kv_caches, shared_kv_tensors
from worker.kv_tiers import KVTiers, Pairs, build_kv_tiers
from worker.model_runner import ModelRunner
from worker.models.fake.reference import reference_generate
from worker.models.registry import build_model, get_model_info

BLOCK_SIZE = 4
NUM_BLOCKS = 8
NUM_HOST_SLOTS = 4
NUM_DISK_SLOTS = 4
DEVICE = torch.device(worker_test_device())  # cuda under `pytest --device cuda`: a side stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_tiers(
    tmp_path: Path, model_name: str = "tiny-llama-hybrid", num_disk_slots: int = NUM_DISK_SLOTS
) -> tuple[KVTiers, list[torch.Tensor]]:
    """Tiers over a model's shared KV tensors, every page filled with distinct random bytes."""
    info = get_model_info(model_name, BLOCK_SIZE)
    config = KVCacheConfig(
        NUM_BLOCKS,
        info.kv_cache_groups,
        num_host_slots=NUM_HOST_SLOTS,
        num_disk_slots=num_disk_slots,
        disk_dir=str(tmp_path),
    )
    kv_caches = allocate_kv_caches(config, 1, DEVICE)
    tiers = build_kv_tiers(config, kv_caches, 1, rank=0)
    assert tiers is not None
    generator = torch.Generator().manual_seed(0)
    for pages in tiers.device_pages:
        fill = torch.randint(0, 256, pages[1:].shape, dtype=torch.uint8, generator=generator)
        pages[1:] = fill.to(pages.device)
    return tiers, tiers.device_pages


def transfers(**lists: list[tuple[int, int]]) -> KVTransfers:
    return KVTransfers(
        **{name: pack_int32(x for pair in pairs for x in pair) for name, pairs in lists.items()}
    )


def page(device_pages: list[torch.Tensor], block_id: int) -> list[bytes]:
    """One block id's page in every shared tensor."""
    return [pages[block_id].cpu().numpy().tobytes() for pages in device_pages]


def test_pages_round_trip_exactly_through_host_and_disk(tmp_path: Path) -> None:
    tiers, pages = make_tiers(tmp_path)
    assert len(pages) == 2 and tiers.payload_bytes == bytes_per_block(
        get_model_info("tiny-llama-hybrid", BLOCK_SIZE).kv_cache_groups, 1
    )
    before = {block_id: page(pages, block_id) for block_id in range(1, NUM_BLOCKS)}
    # blocks 1-3 are one run, 6 and 5 go to scattered slots
    assert tiers.apply(transfers(device_to_host=[(1, 0), (2, 1), (3, 2), (6, 3)])) == []
    assert tiers.apply(transfers(host_to_disk=[(0, 2), (1, 3), (2, 0), (3, 1)])) == []
    assert tiers.apply(transfers(device_to_host=[(5, 0)])) == []
    assert tiers.apply(transfers(disk_to_host=[(2, 1), (3, 2), (0, 3)])) == []
    # the host now holds 5, 1, 2, 3; the disk 3, 6, 1, 2
    assert tiers.apply(transfers(host_to_device=[(0, 4), (1, 5), (2, 6), (3, 7)])) == []
    assert [page(pages, b) for b in (4, 5, 6, 7)] == [before[5], before[1], before[2], before[3]]
    assert tiers.apply(transfers(disk_to_host=[(1, 0)], host_to_device=[(0, 1)])) == []
    assert page(pages, 1) == before[6]
    tiers.check_invariants()
    tiers.close()


def test_runs_group_only_stretches_where_both_sides_advance_by_one() -> None:
    pairs = Pairs.decode(pack_int32([1, 0, 2, 1, 3, 2, 7, 3, 5, 4, 6, 5]), "x", 8, 8)
    assert pairs.runs() == [(1, 0, 3), (7, 3, 1), (5, 4, 2)]


def test_a_step_copies_out_before_it_copies_in(tmp_path: Path) -> None:
    """Within one step a slot is read before a later list overwrites it: host slot 0 goes to
    disk before block 2 replaces it, and block 3's copy-out is what host slot 1 copies in."""
    tiers, pages = make_tiers(tmp_path)
    block_1, block_2, block_3 = page(pages, 1), page(pages, 2), page(pages, 3)
    assert tiers.apply(transfers(device_to_host=[(1, 0)])) == []
    step = transfers(
        host_to_disk=[(0, 0)],
        device_to_host=[(2, 0), (3, 1)],
        disk_to_host=[(0, 2)],
        host_to_device=[(1, 4), (2, 5), (0, 6)],
    )
    assert tiers.apply(step) == []
    assert page(pages, 4) == block_3 and page(pages, 5) == block_1 and page(pages, 6) == block_2


def test_a_corrupt_disk_slot_is_a_failed_slot_and_an_empty_host_slot(tmp_path: Path) -> None:
    tiers, _ = make_tiers(tmp_path)
    assert tiers.apply(transfers(device_to_host=[(1, 0), (2, 1)])) == []
    assert tiers.apply(transfers(host_to_disk=[(0, 0), (1, 1)])) == []
    disk = tiers.disk
    assert disk is not None
    with open(disk.path, "r+b") as file:  # one flipped byte in the middle of slot 1's payload
        offset = disk.slot_bytes + SLOT_HEADER.size + disk.payload_bytes // 2
        file.seek(offset)
        flipped = bytes([file.read(1)[0] ^ 0xFF])
        file.seek(offset)
        file.write(flipped)
    assert tiers.apply(transfers(disk_to_host=[(0, 2), (1, 3)])) == [1]
    assert disk.num_failed_reads == 1
    assert tiers.is_host_written.tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match=r"reads empty host slots \[3\]"):
        tiers.apply(transfers(host_to_device=[(2, 5), (3, 6)]))
    # the emptied host slot's block was lost: moving it down fails its disk slot too
    assert tiers.apply(transfers(host_to_disk=[(3, 2)])) == [2]
    assert tiers.apply(transfers(disk_to_host=[(2, 0)])) == [2]


def test_a_failing_disk_write_is_a_failed_slot_that_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers, _ = make_tiers(tmp_path)
    assert tiers.apply(transfers(device_to_host=[(1, 0), (2, 1)])) == []
    assert tiers.apply(transfers(host_to_disk=[(0, 0)])) == []

    def full_disk(fd: int, buffers: list[object], offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full_disk)
    # slot 0 held block 1; its failed overwrite leaves it empty, not holding the old block
    assert tiers.apply(transfers(host_to_disk=[(1, 0), (0, 1)])) == [0, 1]
    monkeypatch.undo()
    assert tiers.apply(transfers(disk_to_host=[(0, 2), (1, 3)])) == [0, 1]
    assert tiers.disk is not None and tiers.disk.num_failed_writes == 2


def test_a_disk_that_cannot_be_preallocated_fails_every_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    tiers, _ = make_tiers(tmp_path)
    assert tiers.disk is not None and tiers.disk.is_broken
    assert os.listdir(tmp_path) == []  # the half-made file is gone
    assert tiers.apply(transfers(device_to_host=[(1, 0)])) == []
    assert tiers.apply(transfers(host_to_disk=[(0, 3)], disk_to_host=[(3, 1)])) == [3, 3]
    tiers.check_invariants()


def test_the_disk_file_is_named_by_rank_and_generation_and_removed_on_close(
    tmp_path: Path,
) -> None:
    tiers, _ = make_tiers(tmp_path)
    assert tiers.disk is not None
    assert os.listdir(tmp_path) == [disk_file_name(0, 1)]
    assert disk_file_name(0, 1) != disk_file_name(1, 1) != disk_file_name(0, 2)
    assert os.path.getsize(tiers.disk.path) == NUM_DISK_SLOTS * tiers.disk.slot_bytes
    tiers.close()
    assert os.listdir(tmp_path) == []


def test_files_of_ranks_that_are_gone_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    live = disk_file_name(0, 1)  # this process's
    dead = live.replace(f"pid{os.getpid()}", "pid999999999")
    other = "notes.txt"
    for name in (live, dead, other):
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_files(str(tmp_path)) == [dead]
    assert sorted(os.listdir(tmp_path)) == sorted([live, other])


def test_bad_transfers_name_the_list_and_the_values(tmp_path: Path) -> None:
    tiers, _ = make_tiers(tmp_path)
    with pytest.raises(ValueError, match=r"device_to_host writes \[4\], expected 0 to 4"):
        tiers.apply(transfers(device_to_host=[(1, 4)]))
    with pytest.raises(ValueError, match=r"host_to_device writes \[0\], expected 1 to 8"):
        tiers.apply(transfers(host_to_device=[(0, 0)]))
    with pytest.raises(ValueError, match="writes one destination twice"):
        tiers.apply(transfers(device_to_host=[(1, 0), (2, 0)]))
    with pytest.raises(ValueError, match="expected int32 pairs"):
        tiers.apply(KVTransfers(disk_to_host=b"\0" * 4))
    no_disk, _ = make_tiers(tmp_path, num_disk_slots=0)
    with pytest.raises(ValueError, match=r"host_to_disk writes \[0\], expected 0 to 0"):
        no_disk.apply(transfers(device_to_host=[(1, 0)], host_to_disk=[(0, 0)]))


def test_a_prefix_copied_back_through_the_tiers_gives_the_reference_tokens(
    tmp_path: Path,
) -> None:
    """The model reads pages copied back in exactly as if they had never left: request 2 shares
    request 1's first block, which went to disk and came back as block 4, and samples the
    reference token. A zeroed page would change it."""
    prompt_1, prompt_2 = [11, 12, 13, 14, 15, 16], [11, 12, 13, 14, 27, 28, 29]
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def reference(prompt: list[int]) -> list[int]:
        return reference_generate("tiny-llama", prompt, params)[:1]

    info = get_model_info("tiny-llama", BLOCK_SIZE)
    config = KVCacheConfig(
        NUM_BLOCKS, info.kv_cache_groups, num_host_slots=2, num_disk_slots=2, disk_dir=str(tmp_path)
    )
    kv_caches = allocate_kv_caches(config, 1, DEVICE)
    tiers = build_kv_tiers(config, kv_caches, 1, rank=0)
    assert tiers is not None
    model = build_model("tiny-llama", single_rank_group(), DEVICE)
    runner = ModelRunner(
        model,
        config,
        kv_caches,
        0,
        info.max_model_len,
        DEVICE,
        check_each_step=True,
        kv_tiers=tiers,
    )

    def step(
        step_id: int, new: list[NewRequestData], finished: list[int], moves: KVTransfers
    ) -> list[int]:
        counts = [len(unpack_int32(r.prompt_token_ids)) - r.num_computed_tokens for r in new]
        scheduler_output = SchedulerOutput(
            step_id,
            new,
            CachedRequestData(),
            pack_int32(counts),
            sum(counts),
            finished,
            [],
            kv_transfers=moves,
        )
        out = runner.execute_model(scheduler_output)
        assert unpack_int32(out.failed_disk_slots).tolist() == []
        return unpack_int32(out.sampled_token_ids).tolist()

    new_1 = NewRequestData(1, pack_int32(prompt_1), params, ([1, 2],), 0)
    assert step(1, [new_1], [], KVTransfers()) == reference(prompt_1)
    # request 1 finishes, its full first block moves down to the host, then to disk
    assert step(2, [], [1], transfers(device_to_host=[(1, 1)])) == []
    for pages in shared_kv_tensors(config, kv_caches, 1):
        pages[1:3] = 0  # the pool reused blocks 1 and 2: nothing of request 1 is left on device
    assert step(3, [], [], transfers(host_to_disk=[(1, 0)])) == []
    assert step(4, [], [], transfers(disk_to_host=[(0, 0)])) == []
    new_2 = NewRequestData(2, pack_int32(prompt_2), params, ([4, 5],), BLOCK_SIZE)
    assert step(5, [new_2], [], transfers(host_to_device=[(0, 4)])) == reference(prompt_2)
    tiers.close()
