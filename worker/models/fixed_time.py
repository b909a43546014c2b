"""fixed-time: the checksum model's tokens and paged-cache reads and writes, each forward held to
a set time, as a GPU's would be, so that what the engine costs per step shows against a known one.

It runs checksum's real work first, then sleeps (using no CPU) until step_s has passed since the
forward began. It never ends a forward early, and cannot hide work that takes longer than step_s.
"""

import dataclasses
import time

import torch

from worker.attention import KVContext
from worker.distributed import TPGroup
from worker.models.checksum import CHECKSUM, ChecksumConfig, ChecksumModel

# checksum's shapes and token rule under a name of its own, so a rank's ModelInfo says which runs
FIXED_TIME: ChecksumConfig = dataclasses.replace(CHECKSUM, name="fixed-time")


def hold_until(deadline_s: float) -> None:
    """Sleep until time.perf_counter() reaches deadline_s; at once if it already has."""
    while (remaining_s := deadline_s - time.perf_counter()) > 0:
        time.sleep(remaining_s)


class FixedTimeModel:
    """The checksum model on one TP rank, each forward lasting at least step_s seconds.

    Token rule: checksum's (worker/models/checksum.py), read back from the same paged cache.
    Invariants: the wrapped checksum model's; step_s > 0.
    """

    def __init__(self, checksum: ChecksumModel, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError(f"{FIXED_TIME.name} step time {step_s} s: expected > 0")
        self.checksum = checksum
        self.step_s = step_s
        self.vocab_size = checksum.vocab_size

    def check_invariants(self) -> None:
        self.checksum.check_invariants()
        assert self.step_s > 0, f"{FIXED_TIME.name} step time {self.step_s} s"

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """checksum's logits [S, V] float64, returned no earlier than step_s after the call."""
        start_s = time.perf_counter()
        logits = self.checksum.forward(token_ids, positions, logits_idx, kv)
        hold_until(start_s + self.step_s)
        return logits


def build_fixed_time(tp_group: TPGroup, device: torch.device, step_ms: float) -> FixedTimeModel:
    return FixedTimeModel(ChecksumModel(FIXED_TIME, tp_group, device), step_ms / 1000)
