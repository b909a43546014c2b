"""A rank's device and its group's backend: LOCAL_RANK or --device-index pick the device (never the
global rank), and ranks that share a device use gloo, each with its share of the device."""

import itertools

import pytest
import torch

from worker.distributed import (
    TPGroup,
    choose_backend,
    choose_device,
    choose_device_index,
    gather_device_keys,
    single_rank_group,
)


@pytest.mark.parametrize(
    ("local_rank", "num_devices", "expected"),
    [
        (None, 1, 0),
        (None, 4, 0),
        (0, 1, 0),
        (1, 1, 0),  # two local ranks on one device: both on cuda:0
        (3, 1, 0),
        (1, 2, 1),
        (2, 2, 0),  # three local ranks on two devices: 0 and 2 share cuda:0
        (3, 4, 3),
        (5, 4, 1),
    ],
)
def test_the_device_is_the_local_rank_modulo_the_visible_devices(
    local_rank: int | None, num_devices: int, expected: int
) -> None:
    assert choose_device_index(None, local_rank, num_devices) == expected


@pytest.mark.parametrize("local_rank", [None, 0, 1, 5])
def test_an_explicit_device_index_wins_over_the_local_rank(local_rank: int | None) -> None:
    assert choose_device_index(1, local_rank, 2) == 1
    assert choose_device("cuda", 1, local_rank, 2) == torch.device("cuda", 1)


def test_a_device_index_past_the_visible_devices_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device_index 2 is outside \[0, 2\)"):
        choose_device_index(2, None, 2)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        choose_device("cuda", None, 0, 0)


def test_the_global_rank_never_picks_the_device() -> None:
    """Rank 9 of a job, local rank 1 on its host of two GPUs: cuda:1, whatever its global rank."""
    assert choose_device("cuda", None, 1, 2) == torch.device("cuda", 1)
    assert choose_device("auto", None, 1, 2) == torch.device("cuda", 1)


@pytest.mark.parametrize("local_rank", [None, 0, 3])
def test_auto_without_cuda_and_cpu_pick_the_cpu(local_rank: int | None) -> None:
    assert choose_device("auto", None, local_rank, 0) == torch.device("cpu")
    assert choose_device("cpu", None, local_rank, 4) == torch.device("cpu")


def _keys(device_indices: list[int | None]) -> list[str]:
    """One host's ranks on the given CUDA devices (None: on the CPU)."""
    return ["host/cpu" if idx is None else f"host/uuid-{idx}" for idx in device_indices]


@pytest.mark.parametrize(
    ("num_local_ranks", "num_devices"),
    list(itertools.product([2, 3, 4], [1, 2, 3, 4])),
)
def test_auto_takes_nccl_only_when_every_rank_has_a_device_of_its_own(
    num_local_ranks: int, num_devices: int
) -> None:
    indices = [choose_device_index(None, r, num_devices) for r in range(num_local_ranks)]
    keys = _keys(indices)
    is_shared = num_local_ranks > num_devices
    for rank in range(num_local_ranks):
        backend, num_on_device = choose_backend("auto", keys, rank)
        assert backend == ("gloo" if is_shared else "nccl")
        assert num_on_device == indices.count(indices[rank])
        assert choose_backend("gloo", keys, rank) == ("gloo", num_on_device)
        if is_shared:
            with pytest.raises(ValueError, match=r"ranks \[.*\] share a device, which nccl"):
                choose_backend("nccl", keys, rank)
        else:
            assert choose_backend("nccl", keys, rank) == ("nccl", 1)


def test_ranks_on_different_hosts_with_one_device_each_use_nccl() -> None:
    keys = ["a/uuid-0", "b/uuid-0"]  # the same uuid text on two hosts: different devices
    assert choose_backend("auto", keys, 1) == ("nccl", 1)


def test_the_same_device_under_two_cuda_visible_devices_numberings_is_shared() -> None:
    """Keys name devices by uuid, so cuda:0 of one process and cuda:1 of another can match."""
    assert choose_backend("auto", ["h/uuid-7", "h/uuid-7"], 0) == ("gloo", 2)


def test_cpu_ranks_use_gloo_and_refuse_nccl() -> None:
    keys = _keys([None, None])
    assert choose_backend("auto", keys, 0) == ("gloo", 2)
    with pytest.raises(ValueError, match="nccl needs CUDA devices"):
        choose_backend("nccl", keys, 0)
    with pytest.raises(ValueError, match=r"ranks \[1\] run on the CPU and the others on CUDA"):
        choose_backend("auto", _keys([0, None]), 0)
    with pytest.raises(ValueError, match="unknown distributed backend 'mpi'"):
        choose_backend("mpi", keys, 0)


def test_a_group_counts_its_ranks_on_the_device() -> None:
    assert single_rank_group().num_ranks_on_device == 1
    with pytest.raises(ValueError, match=r"num_ranks_on_device=3 is outside \[1, 2\]"):
        TPGroup(0, 2, object(), num_ranks_on_device=3)  # type: ignore[arg-type]


def test_device_keys_cross_as_fixed_size_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank gather: the key comes back whole, padding stripped."""

    def gather(outputs: list[torch.Tensor], mine: torch.Tensor) -> None:
        outputs[0].copy_(mine)

    monkeypatch.setattr("torch.distributed.all_gather", gather)
    assert gather_device_keys("host-1/GPU-1234", 1) == ["host-1/GPU-1234"]
