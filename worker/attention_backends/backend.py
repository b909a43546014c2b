"""The attention seam: a backend turns one step's PagedKV into the StepAttention a model's layers
call to write their K/V and attend.

Backends (`--attention-backend`):
- `reference`: one gathered row per context token, then SDPA (reference.py). Every other path is
  checked against it.
- `blocks`: whole blocks gathered, then SDPA under a mask (block_gather.py); the default off the
  CPU.
- `native`: `blocks`, with single-query rows attended by a compiled kernel that reads the pages
  in place (native_cpu.py; CPU only); the default on the CPU. Built at first use with the host's
  C++ compiler; without one it is `blocks`.
- `triton`: paged kernels that read the block table in place (CUDA only; triton_backend.py). It
  also takes a DeviceStep, the step buffers' inputs computed on the device (worker/step_buffers.py).

A backend never changes what a query may read: that is `worker/attention.read_bounds`, per spec.
"""

from collections.abc import Callable
from typing import Protocol

import torch

from worker.attention import PagedKV

ATTENTION_BACKENDS = ("auto", "reference", "blocks", "native", "triton")


class StepAttention(Protocol):
    """One step's attention for the layers of a checkpoint's model."""

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [T, KV_r, head_dim] of every scheduled token (before any read)."""
        ...

    def attend(
        self,
        layer_name: str,
        q: torch.Tensor,
        scale: float,
        logits_only: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention [T, H_r * head_dim] of the rotated queries q [T, H_r, head_dim].

        With `logits_only` only each sampled request's last token needs its row (the others may
        stay zero); `softcap` caps the scores as `softcap * tanh(score / softcap)`.
        """
        ...


AttentionBackend = Callable[[PagedKV], StepAttention]


def resolve_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend `name` builds each step's StepAttention with; `auto` is `native` on the CPU
    and `blocks` elsewhere.

    `triton` must be asked for: its kernels are checked against the reference under Triton's
    interpreter, and `auto` takes them once a GPU run has checked them too.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected one of {list(ATTENTION_BACKENDS)}")
    if name == "reference":
        from worker.attention_backends.reference import ReferenceAttention

        return ReferenceAttention
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(
                f"attention backend 'triton' runs on CUDA devices only, not on {device.type}"
            )
        from worker.attention_backends.triton_backend import TritonBackend

        return TritonBackend
    if name == "native" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(
                f"attention backend 'native' runs on the CPU only, not on {device.type}"
            )
        from worker.attention_backends.native_build import load_native
        from worker.attention_backends.native_cpu import NativeCPUAttention

        load_native()  # built now, at start-up, rather than in the first step
        return NativeCPUAttention
    from worker.attention_backends.block_gather import BlockGatherAttention

    return BlockGatherAttention
