"""The workers' tensor-parallel group: device and backend choice, setup, teardown, and all-reduce.

Why a plain all-reduce gives TP=1's exact bits: the models keep every partial sum on a fixed-point
grid held in float64 (worker/numerics/fixed_point.py; checksum uses int64), so each rank's partial
sum and their total are exact: the reduction order, the ring and the kernel cannot change the
result.
"""

import contextlib
import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

from worker.shm_all_reduce import (
    NAME_PREFIX,
    ShmAllReduce,
    create_segment,
    is_process_alive,
    unlink_segment,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
DEVICE_KEY_BYTES = 256  # a rank's "host/device" name, padded, as gathered from every rank


class TPGroup:
    """The ranks that shard one model; every rank calls `all_reduce` in the same order.

    Invariants: 0 <= rank < tp_size; a group of size > 1 has an initialized process group;
    1 <= num_ranks_on_device <= tp_size.
    """

    def __init__(
        self,
        rank: int,
        tp_size: int,
        process_group: dist.ProcessGroup | None = None,
        num_ranks_on_device: int = 1,  # ranks of this group on this rank's device, itself included
        shm: ShmAllReduce | None = None,  # CPU ranks on one host all-reduce through it
    ) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is outside [0, {tp_size})")
        if tp_size > 1 and process_group is None:
            raise ValueError(f"a group of tp_size={tp_size} needs a process group")
        if not 1 <= num_ranks_on_device <= tp_size:
            raise ValueError(f"num_ranks_on_device={num_ranks_on_device} is outside [1, {tp_size}]")
        self.rank = rank
        self.tp_size = tp_size
        self.process_group = process_group
        self.num_ranks_on_device = num_ranks_on_device
        self.shm = shm

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; a no-op for a single rank. Every rank takes the
        same path for the same tensor: the shared segment when it has one that accepts it."""
        if self.tp_size > 1 and tensor.numel():
            if self.shm is not None and self.shm.accepts(tensor):
                return self.shm.all_reduce(tensor)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        return tensor

    def check_invariants(self) -> None:
        assert 0 <= self.rank < self.tp_size, f"rank {self.rank} outside [0, {self.tp_size})"
        assert self.tp_size == 1 or dist.is_initialized(), "tp group without a process group"
        assert 1 <= self.num_ranks_on_device <= self.tp_size, (
            f"num_ranks_on_device={self.num_ranks_on_device} outside [1, {self.tp_size}]"
        )


def choose_device_index(device_index: int | None, local_rank: int | None, num_devices: int) -> int:
    """The CUDA device of a rank: `device_index` when given, else LOCAL_RANK modulo the visible
    devices (local ranks past the device count share devices), else device 0.

    Never the global rank: on the second host of a job it names devices that host lacks.
    """
    if num_devices < 1:
        raise ValueError("device cuda was asked for, but no CUDA device is visible")
    if device_index is not None:
        if not 0 <= device_index < num_devices:
            raise ValueError(
                f"device_index {device_index} is outside [0, {num_devices}): "
                f"{num_devices} CUDA devices are visible"
            )
        return device_index
    if local_rank is None:
        return 0
    return local_rank % num_devices


def choose_device(
    device: str, device_index: int | None, local_rank: int | None, num_cuda_devices: int
) -> torch.device:
    """ "cpu", "cuda" (see choose_device_index) or "auto" (cuda when a device is visible)."""
    if device == "auto":
        device = "cuda" if num_cuda_devices > 0 else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}: expected auto, cpu or cuda")
    return torch.device("cuda", choose_device_index(device_index, local_rank, num_cuda_devices))


def resolve_device(device: str, device_index: int | None, local_rank: int | None) -> torch.device:
    """choose_device with the number of CUDA devices this process sees."""
    num_cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_device(device, device_index, local_rank, num_cuda_devices)


def choose_backend(requested: str, device_keys: list[str], rank: int) -> tuple[str, int]:
    """The group's backend and how many ranks share `rank`'s device.

    `device_keys[r]` names rank r's device ("host/cpu" or "host/cuda-uuid"); every rank passes
    the same list, so every rank decides the same. NCCL refuses two ranks of one communicator on
    one device, so auto takes nccl only when every CUDA rank has a device of its own; ranks that
    share one use gloo, which all-reduces CUDA tensors too.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown distributed backend {requested!r}: expected one of {BACKENDS}")
    if not 0 <= rank < len(device_keys):
        raise ValueError(f"rank {rank} is outside [0, {len(device_keys)})")
    num_on_device = device_keys.count(device_keys[rank])
    on_cpu = [r for r, key in enumerate(device_keys) if key.endswith("/cpu")]
    if on_cpu and len(on_cpu) != len(device_keys):
        raise ValueError(f"ranks {on_cpu} run on the CPU and the others on CUDA: expected one kind")
    shared = sorted(r for r, key in enumerate(device_keys) if device_keys.count(key) > 1)
    if requested == "nccl" and on_cpu:
        raise ValueError(
            "distributed backend nccl needs CUDA devices, but the ranks run on the CPU"
        )
    if requested == "nccl" and shared:
        raise ValueError(
            f"ranks {shared} share a device, which nccl refuses: "
            "use --distributed-backend gloo (or auto), or give each rank its own device"
        )
    if requested == "auto":
        requested = "gloo" if on_cpu or shared else "nccl"
    return requested, num_on_device


def device_key(device: torch.device) -> str:
    """This rank's device, named so that two processes on one device get the same name."""
    host = socket.gethostname()
    if device.type != "cuda":
        return f"{host}/cpu"
    # the uuid, not the index: CUDA_VISIBLE_DEVICES may number one device differently per process
    return f"{host}/{torch.cuda.get_device_properties(device).uuid}"


def gather_device_keys(key: str, tp_size: int) -> list[str]:
    """Every rank's device key, over the (gloo) world group; no pickled objects on the wire."""
    raw = key.encode()[:DEVICE_KEY_BYTES].ljust(DEVICE_KEY_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # [DEVICE_KEY_BYTES]
    gathered = [torch.zeros_like(mine) for _ in range(tp_size)]  # tp_size x [DEVICE_KEY_BYTES]
    dist.all_gather(gathered, mine)
    return [bytes(row.numpy()).rstrip(b"\0").decode() for row in gathered]


def single_rank_group() -> TPGroup:
    return TPGroup(0, 1)


def init_tp_group(
    rank: int,
    tp_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    device: torch.device,
    backend: str = "auto",
) -> TPGroup:
    """Join the TP group at tcp://master_addr:master_port over `backend` (see choose_backend).

    Every rank must call it within `timeout_s`, and each collective must finish within it too: a
    missing or dead rank raises instead of hanging.
    """
    if tp_size == 1:
        return single_rank_group()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # Every rank meets over gloo first: it runs on any device, and the device keys gathered over
    # it decide whether nccl can work at all.
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=tp_size,
        timeout=timeout,
    )
    keys = gather_device_keys(device_key(device), tp_size)
    chosen, num_on_device = choose_backend(backend, keys, rank)
    group = dist.group.WORLD
    if chosen == "nccl":
        group = dist.new_group(list(range(tp_size)), timeout=timeout, backend="nccl")
    # one hostname: maybe one host; an explicit --distributed-backend gloo keeps gloo's own
    is_one_host = backend == "auto" and device.type == "cpu" and len(set(keys)) == 1
    shm = join_shm_all_reduce(rank, tp_size, timeout_s) if is_one_host else None
    logger.info(
        "rank %d joined a TP group of %d over %s%s (%d ranks on %s)",
        rank,
        tp_size,
        chosen,
        ", all-reducing through shared memory" if shm is not None else "",
        num_on_device,
        device,
    )
    return TPGroup(rank, tp_size, group, num_on_device, shm)


def join_shm_all_reduce(rank: int, tp_size: int, timeout_s: float) -> ShmAllReduce | None:
    """Rank 0 makes the segment, every rank maps it, and all use it only if all could (ranks in
    other containers of one hostname see another /dev/shm); it is unlinked once all mapped it."""
    name = ""
    if rank == 0:
        try:
            name = create_segment(tp_size)
        except OSError as exc:
            logger.info("no shared-memory all-reduce: %s", exc)
    try:
        raw = torch.tensor(list(name.encode().ljust(64, b"\0")), dtype=torch.uint8)
        dist.broadcast(raw, src=0)
        name = bytes(raw.numpy()).rstrip(b"\0").decode()
        shm, pids = None, torch.zeros(tp_size, dtype=torch.int64)
        if name.startswith(NAME_PREFIX):
            with contextlib.suppress(OSError):
                shm = ShmAllReduce(name, rank, [0] * tp_size, timeout_s)
        pids[rank] = os.getpid() if shm is not None else 0
        dist.all_reduce(pids)  # every rank's pid, 0 where it could not map the segment
    finally:  # every rank has mapped it, or the group failed: either way no one else will
        if rank == 0 and name:
            unlink_segment(name)
    # a peer's pid must name it here too (one PID namespace), or a wait would take it for gone
    sees_peers = torch.tensor([int(all(map(is_process_alive, pids.tolist())))])
    dist.all_reduce(sees_peers, op=dist.ReduceOp.MIN)
    if shm is not None and (bool((pids == 0).any()) or not sees_peers.item()):
        shm.close()
        shm = None
    if shm is not None:
        shm.peer_pids = pids.tolist()
    return shm


def destroy_tp_group(group: TPGroup) -> None:
    """Leave the group; safe to call for a single rank or twice."""
    if group.shm is not None:
        group.shm.close()
        group.shm = None
    if group.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
