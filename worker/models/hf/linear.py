"""The checkpoint's linear layers: y = x W^T + b, with each weight pre-packed for oneDNN on the CPU.

On the CPU, F.linear hands the plain [out, in] weight to the GEMM, which re-lays it for its
kernel on every call. oneDNN's packed layout does that once, at load. Measured on this project's
2-core host (AVX-512 with bf16, one thread, torch 2.13): [16, 576] x [576, 1536] takes 269 us
packed against 407 us plain in float32, and 146 against 197 us in bfloat16; [256, 576] 4.2 against
4.8 ms. A packed float32 result differs from F.linear's in the last bits (another summation
order), which DESIGN §7.1's top-2 margin tolerance covers; bfloat16's is equal.

A packed weight is an opaque oneDNN tensor of the same shape and dtype (`to_dense()` gives the
weight back exactly). CUDA weights, and every weight where oneDNN is missing, stay plain. A weight
kept in fp8 (fp8_linear.py, CUDA) runs its own scaled GEMM.
"""

import logging

import torch
import torch.nn.functional as F

from worker.models.hf.fp8_linear import Fp8Linear

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACKING_BATCH_HINT = 16  # rows oneDNN chooses the layout for; any count runs on it


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` should be packed: a CPU float32 or bfloat16 matrix, oneDNN present."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's layout of `weight` [out, in] where `can_pack`; the weight itself elsewhere."""
    if not can_pack(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_BATCH_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Linear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]): [T, out], packed, plain or fp8 alike."""
    if isinstance(weight, Fp8Linear):
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
