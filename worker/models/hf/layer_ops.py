"""The decoder's normalization and pointwise steps behind one seam: RMSNorm (with the residual
add), SiLU-and-multiply, the per-head q/k norm with rotary, and a sparse layer's experts.
TorchLayerOps is the CPU path and the reference; on CUDA the decoder runs FusedLayerOps
(fused_kernels.py), one kernel per step (the experts: moe.py's grouped path until a fused MoE
kernel replaces it there).

This module never imports triton: `layer_ops_for` imports the kernels only for a CUDA device,
and takes them only once they have agreed with torch's ops there (`check_fused_ops`).
"""

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.models.hf.moe import MoeWeights, grouped_moe
from worker.models.hf.rope import rotate

logger = logging.getLogger(__name__)

FUSED_CHECK_TOLERANCE = 1e-4  # float32, small inputs: the kernels differ by a sum's order only


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, cast back to x's dtype, then scaled by the weight (in that dtype)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, then cast to x's dtype (the
    product rounds once, unlike rms_norm's)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


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

    def moe(self, h: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
        """This rank's partial output [T, D] of a sparse layer's experts on the normed h [T, D],
        routed and weighted as moe.grouped_moe does (the decoder all-reduces it)."""
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

    def moe(self, h: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
        return grouped_moe(h, weights, self.silu_and_mul)


def layer_ops_for(device: torch.device) -> LayerOps:
    """The fused kernels on a CUDA device where they agree with torch's ops; torch's ops
    everywhere else."""
    if device.type != "cuda":
        return TorchLayerOps()
    from worker.models.hf.fused_kernels import FusedLayerOps

    fused = FusedLayerOps()
    problem = check_fused_ops(fused, device)
    if problem is None:
        return fused
    logger.warning("fused layer kernels off on %s (%s): torch's ops run instead", device, problem)
    return TorchLayerOps()


def check_fused_ops(ops: LayerOps, device: torch.device) -> str | None:
    """What makes `ops` unusable on `device`, or None: each step run once on small float32
    inputs and compared with TorchLayerOps. A kernel that cannot compile for this device (a new
    card, an old Triton) is a reason too, so that the decoder falls back instead of failing."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    x, residual, weight = rand(3, 64), rand(3, 64), rand(64)
    q, k, cos, sin = rand(3, 4, 16), rand(3, 2, 16), rand(3, 16), rand(3, 16)
    q_norm, k_norm, gate_up = rand(16), rand(16), rand(3, 128)
    reference = TorchLayerOps()
    cases = {
        "rms_norm": lambda o: (o.rms_norm(x, weight, 1e-6),),
        "add_rms_norm": lambda o: o.add_rms_norm(x, residual.clone(), weight, 1e-6),
        "silu_and_mul": lambda o: (o.silu_and_mul(gate_up),),
        "norm_and_rotate": lambda o: o.norm_and_rotate(
            q.clone(), k.clone(), q_norm, k_norm, 1e-6, cos, sin
        ),
    }
    for name, run in cases.items():
        try:
            got = run(ops)
        except Exception as exc:  # a kernel's compile or launch failure: fall back, said
            return f"{name} raised {type(exc).__name__}: {exc}"
        for ours, theirs in zip(got, run(reference), strict=True):
            error = float((ours - theirs).abs().max())
            if not error <= FUSED_CHECK_TOLERANCE:
                return f"{name} differs from torch's ops by {error:.3g}"
    return None
