"""The workers' tensor-parallel group: setup and teardown over torch.distributed, and all-reduce.

Why a plain all-reduce gives TP=1's exact bits: the models keep every partial sum on a fixed-point
grid held in float64 (worker/models/fixed_point.py; checksum uses int64), so each rank's partial sum
and their total are exact: the reduction order, the ring and the kernel cannot change the result.
"""

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class TPGroup:
    """The ranks that shard one model; every rank calls `all_reduce` in the same order.

    Invariants: 0 <= rank < tp_size; a group of size > 1 has an initialized process group.
    """

    def __init__(
        self, rank: int, tp_size: int, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is outside [0, {tp_size})")
        if tp_size > 1 and process_group is None:
            raise ValueError(f"a group of tp_size={tp_size} needs a process group")
        self.rank = rank
        self.tp_size = tp_size
        self.process_group = process_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; a no-op for a single rank."""
        if self.tp_size > 1 and tensor.numel():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        return tensor

    def check_invariants(self) -> None:
        assert 0 <= self.rank < self.tp_size, f"rank {self.rank} outside [0, {self.tp_size})"
        assert self.tp_size == 1 or dist.is_initialized(), "tp group without a process group"


def resolve_device(device: str, rank: int) -> torch.device:
    """ "cpu", "cuda" (rank modulo the visible GPUs) or "auto" (cuda when available)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}: expected auto, cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA device is visible")
    return torch.device("cuda", rank % torch.cuda.device_count())


def single_rank_group() -> TPGroup:
    return TPGroup(0, 1)


def init_tp_group(
    rank: int,
    tp_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    device: torch.device,
) -> TPGroup:
    """Join the TP group at tcp://master_addr:master_port (gloo on the CPU, nccl on CUDA).

    Every rank must call it within `timeout_s`; a missing rank raises instead of hanging.
    """
    if tp_size == 1:
        return single_rank_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=tp_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    logger.info("rank %d joined a TP group of %d over %s", rank, tp_size, backend)
    return TPGroup(rank, tp_size, dist.group.WORLD)


def destroy_tp_group(group: TPGroup) -> None:
    """Leave the group; safe to call for a single rank or twice."""
    if group.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
