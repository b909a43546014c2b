"""The decoder's normalization and pointwise steps behind one seam: RMSNorm (with the residual
add), SiLU-and-multiply, and the per-head q/k norm with rotary. TorchLayerOps is the CPU path and
the reference; on CUDA the decoder runs FusedLayerOps (fused_kernels.py), one kernel per step.

This module never imports triton: `layer_ops_for` imports the kernels only for a CUDA device.
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from worker.models.hf.rope import rotate


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, cast back to x's dtype, then scaled by the weight (in that dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LayerOps(Protocol):
    """What a decoder layer computes between its GEMMs and its attention."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x) of x and residual [T, D]; the sum is rounded
        to their dtype before the norm, and `residual` may be updated in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, I] of the merged gate/up output [T, 2 * I]."""
        ...

    def norm_and_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, head_dim] and k [T, KV, head_dim], each head RMS-normed when its weight is
        given (Qwen3), then rotated by cos and sin [T, head_dim]; q and k may change in place."""
        ...


class TorchLayerOps:
    """The steps as torch ops on new tensors: the CPU path, and the reference of the kernels."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_and_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q_norm is not None and k_norm is not None:  # Qwen3: per head, pre-rotary
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def layer_ops_for(device: torch.device) -> LayerOps:
    """The fused kernels on a CUDA device; torch's ops everywhere else."""
    if device.type == "cuda":
        from worker.models.hf.fused_kernels import FusedLayerOps

        return FusedLayerOps()
    return TorchLayerOps()
