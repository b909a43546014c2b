"""Triton kernels of the decoder's steps between GEMMs, one launch each where torch takes several:
RMSNorm with the residual add, SiLU-and-multiply, and the per-head q/k norm with rotary in place;
and FusedLayerOps, the LayerOps (layer_ops.py) that runs them. Importing this module imports
triton: only a CUDA decoder (or a test under TRITON_INTERPRET=1) may import it.

Each kernel rounds where torch's ops in the compute dtype round (layer_ops.TorchLayerOps), so a
bfloat16 result differs from torch's only where a float32 sum, taken in another order, rounds the
other way; norms take an IEEE square root and division, as torch's CPU rsqrt does.
"""

import torch
import triton
import triton.language as tl

from worker.models.hf.moe import MoeWeights, grouped_moe

SILU_BLOCK_SIZE = 1024  # output columns per program of silu_and_mul


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_ops.rms_norm of the rows of x [T, D]: a new tensor."""
    out = torch.empty_like(x)  # [T, D]
    _launch_rms_norm(x, None, weight, eps, out)
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (rounded to their dtype), in place; returns rms_norm(residual) [T, D]."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm_ got x {tuple(x.shape)} {x.dtype} and residual "
            f"{tuple(residual.shape)} {residual.dtype}: expected the same shape and dtype"
        )
    out = torch.empty_like(x)  # [T, D]
    _launch_rms_norm(x, residual, weight, eps, out)
    return out


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    num_rows, hidden_size = x.shape
    rows = [x, out] if residual is None else [x, out, residual]
    if weight.shape != (hidden_size,) or any(t.stride(-1) != 1 for t in [*rows, weight]):
        raise ValueError(
            f"rms_norm got x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected weight "
            f"[{hidden_size}] and rows contiguous in their last dimension"
        )
    if num_rows == 0:
        return
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if has_residual else x,  # never read without HAS_RESIDUAL
        weight,
        out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK=triton.next_power_of_2(hidden_size),
        IS_INTERPRETED=x.device.type == "cpu",
        enable_fp_fusion=False,
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride_row,
    residual_stride_row,
    out_stride_row,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_INTERPRETED: tl.constexpr,
):
    """One program per row: (residual + x, stored back), its norm in float32, cast, scaled."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride_row + cols, mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + cols, mask, other=0.0)
        x = _to(residual.to(tl.float32) + x.to(tl.float32), dtype, IS_INTERPRETED)
        tl.store(residual_ptr + row * residual_stride_row + cols, x, mask)
    h = x.to(tl.float32)
    mean_square = tl.div_rn(tl.sum(h * h, axis=0), hidden_size.to(tl.float32))
    normed = _to(h * tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps)), dtype, IS_INTERPRETED)
    weight = tl.load(weight_ptr + cols, mask, other=0.0)
    out = _to(weight.to(tl.float32) * normed.to(tl.float32), dtype, IS_INTERPRETED)
    tl.store(out_ptr + row * out_stride_row + cols, out, mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] of gate_up [T, 2 * I] (gate columns first), rounded as torch's."""
    num_rows, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul got gate_up {tuple(gate_up.shape)}: expected an even width, contiguous"
        )
    intermediate_size = width // 2
    out = gate_up.new_empty((num_rows, intermediate_size))  # [T, I]
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(intermediate_size, SILU_BLOCK_SIZE))
    _silu_and_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        intermediate_size,
        BLOCK=SILU_BLOCK_SIZE,
        IS_INTERPRETED=gate_up.device.type == "cpu",
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_stride_row,
    out_stride_row,
    intermediate_size,
    BLOCK: tl.constexpr,
    IS_INTERPRETED: tl.constexpr,
):
    """Program (row, column block): silu(gate) = gate / (1 + e^-gate) in float32, cast, times up."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    dtype = out_ptr.dtype.element_ty
    row_ptr = gate_up_ptr + row * gate_up_stride_row
    gate = tl.load(row_ptr + cols, mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + intermediate_size + cols, mask, other=0.0)
    silu = _to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype, IS_INTERPRETED)
    out = _to(silu.to(tl.float32) * up.to(tl.float32), dtype, IS_INTERPRETED)
    tl.store(out_ptr + row * out_stride_row + cols, out, mask)


def norm_and_rotate_(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place on q [T, H, head_dim] and k [T, KV, head_dim]: each head RMS-normed when both
    weights [head_dim] are given, then rotated by its token's cos and sin [T, head_dim] as
    rope.rotate does (halves paired as (a, b) -> (a cos - b sin, b cos + a sin))."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    has_norm = q_norm is not None and k_norm is not None
    tables = (num_tokens, head_dim)
    if k.shape != (num_tokens, num_kv_heads, head_dim) or head_dim % 2 or k.dtype != q.dtype:
        raise ValueError(
            f"norm_and_rotate_ got q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} "
            f"{k.dtype}: expected k of q's tokens, head_dim and dtype, and an even head_dim"
        )
    if cos.shape != tables or sin.shape != tables or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(
            f"norm_and_rotate_ got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}: expected "
            f"each [{num_tokens}, {head_dim}], contiguous in the last dimension"
        )
    if num_tokens == 0:
        return
    _norm_rotate_kernel[(num_tokens, num_heads + num_kv_heads)](
        q,
        k,
        q_norm if has_norm else q,  # never read without HAS_NORM
        k_norm if has_norm else k,
        cos,
        sin,
        *q.stride(),
        *k.stride(),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        head_dim // 2,
        eps,
        HAS_NORM=has_norm,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        IS_INTERPRETED=q.device.type == "cpu",
        enable_fp_fusion=False,
    )


@triton.jit
def _norm_rotate_kernel(
    q_ptr,
    k_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    q_stride_token,
    q_stride_head,
    q_stride_dim,
    k_stride_token,
    k_stride_head,
    k_stride_dim,
    cos_stride_token,
    sin_stride_token,
    num_heads,
    half,
    eps,
    HAS_NORM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_INTERPRETED: tl.constexpr,
):
    """Program (token, head): heads [0, num_heads) are q's, the rest k's."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cos_row = cos_ptr + token * cos_stride_token
    sin_row = sin_ptr + token * sin_stride_token
    if head < num_heads:
        head_ptr = q_ptr + token * q_stride_token + head * q_stride_head
        _norm_rotate_head(
            head_ptr,
            q_stride_dim,
            q_norm_ptr,
            cos_row,
            sin_row,
            half,
            eps,
            HAS_NORM,
            HALF_PAD,
            IS_INTERPRETED,
        )
    else:
        head_ptr = k_ptr + token * k_stride_token + (head - num_heads) * k_stride_head
        _norm_rotate_head(
            head_ptr,
            k_stride_dim,
            k_norm_ptr,
            cos_row,
            sin_row,
            half,
            eps,
            HAS_NORM,
            HALF_PAD,
            IS_INTERPRETED,
        )


@triton.jit
def _norm_rotate_head(
    head_ptr,
    stride_dim,
    norm_ptr,
    cos_row,
    sin_row,
    half,
    eps,
    HAS_NORM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_INTERPRETED: tl.constexpr,
):
    """One head's halves a and b, normed and rotated, each product rounded to the dtype where
    torch's `x * cos + turned * sin` rounds it."""
    dims = tl.arange(0, HALF_PAD)
    mask = dims < half
    dtype = head_ptr.dtype.element_ty
    a = tl.load(head_ptr + dims * stride_dim, mask, other=0.0).to(tl.float32)
    b = tl.load(head_ptr + (half + dims) * stride_dim, mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_square = tl.div_rn(
            tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0), (2 * half).to(tl.float32)
        )
        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
        weight_a = tl.load(norm_ptr + dims, mask, other=0.0).to(tl.float32)
        weight_b = tl.load(norm_ptr + half + dims, mask, other=0.0).to(tl.float32)
        a = _rounded(weight_a * _rounded(a * inv_rms, dtype, IS_INTERPRETED), dtype, IS_INTERPRETED)
        b = _rounded(weight_b * _rounded(b * inv_rms, dtype, IS_INTERPRETED), dtype, IS_INTERPRETED)
    cos_a = tl.load(cos_row + dims, mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_row + half + dims, mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_row + dims, mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_row + half + dims, mask, other=0.0).to(tl.float32)
    new_a = _rounded(a * cos_a, dtype, IS_INTERPRETED) + _rounded(-b * sin_a, dtype, IS_INTERPRETED)
    new_b = _rounded(b * cos_b, dtype, IS_INTERPRETED) + _rounded(a * sin_b, dtype, IS_INTERPRETED)
    tl.store(head_ptr + dims * stride_dim, _to(new_a, dtype, IS_INTERPRETED), mask)
    tl.store(head_ptr + (half + dims) * stride_dim, _to(new_b, dtype, IS_INTERPRETED), mask)


@triton.jit
def _to(x, dtype: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """float32 x rounded to `dtype`, to the nearest (ties to even) as torch rounds. Compiled,
    the cast does it; the interpreter's bfloat16 cast truncates, so there it rounds the bits."""
    if IS_INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # bf16 keeps the high 16 bits
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rounded(x, dtype: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """float32 x rounded to `dtype` and widened back: a value torch holds in the dtype."""
    return _to(x, dtype, IS_INTERPRETED).to(tl.float32)


class FusedLayerOps:
    """LayerOps by the kernels above: the residual is updated and q and k rotated in place."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_(x, residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

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
        norm_and_rotate_(q, k, q_norm, k_norm, eps, cos, sin)
        return q, k

    def moe(self, h: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
        # no fused MoE kernel yet: the grouped torch path, with the fused SiLU-and-multiply
        return grouped_moe(h, weights, silu_and_mul)
