"""Fp8Linear: a linear weight kept in float8 e4m3 with its scales, multiplied by
`torch._scaled_mm` after the activations are quantized to float8 too.

On CUDA devices with FP8 tensor cores (compute capability 8.9: Ada, Hopper and later) this halves
a bfloat16 model's weight bytes and runs the GEMM in FP8. `keeps_fp8_weights` decides, from the
device, its capability and the checkpoint's scheme alone, whether a rank takes this path;
everywhere else the weights are dequantized at load (quantization.py) and nothing here runs.

The GEMM: y = (x_fp8 * scale_a) @ (w_fp8 * scale_b)^T, accumulated in float32.
- Weight scales: one per tensor, or one per output channel. A merged weight (q/k/v, gate/up) of
  parts with a scale each gets one per output channel, each part's scale repeated over its rows;
  a rank's rows take their channels' scales, its columns the whole tensor's.
- Activations: `dynamic` quantizes each token's row by its own absolute maximum (a scale per
  token); `static` divides every row by the checkpoint's calibrated `input_scale` (merged parts
  take the largest of theirs, so that no part's input saturates).
- torch._scaled_mm takes both scales per tensor (a scalar each), or both per row of its operands
  ([T, 1] and [1, out]); any mix is expressed as the second, the scalar repeated. Its row-wise
  form writes bfloat16 only (on CUDA), so in a float32 or float16 compute dtype a row-wise
  product runs with unit scales into float32 and is scaled after, rounding once.
- CUDA needs both dimensions of the weight to be multiples of 16 (`can_keep`); a weight that is
  not stays dequantized.
"""

from dataclasses import dataclass

import torch

from worker.models.hf.quantization import Fp8Scheme

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALED_MM_ALIGNMENT = 16  # rows and columns of the weight, on CUDA
MIN_ACTIVATION_SCALE = 1e-12  # an all-zero row keeps a finite scale
ROWWISE_OUT_DTYPE = torch.bfloat16  # the only output of CUDA's row-wise scaled GEMM


def keeps_fp8_weights(
    device_type: str, capability: tuple[int, int] | None, scheme: Fp8Scheme | None
) -> bool:
    """Whether a rank keeps an fp8 checkpoint's weights in fp8 for torch._scaled_mm: on a CUDA
    device of compute capability 8.9 or more, for per-tensor or per-channel weight scales and a
    checkpoint that says how to quantize activations. Block scales and weight-only checkpoints
    are dequantized at load, as is everything on other devices."""
    return (
        scheme is not None
        and device_type == "cuda"
        and capability is not None
        and tuple(capability) >= FP8_MIN_CAPABILITY
        and scheme.block is None
        and scheme.activation_scheme is not None
    )


def can_keep(rows: int, cols: int) -> bool:
    """Whether a rank's [rows, cols] weight slice suits torch._scaled_mm."""
    return rows % SCALED_MM_ALIGNMENT == 0 and cols % SCALED_MM_ALIGNMENT == 0


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] as float8 and its scale: [T, 1] per token (dynamic, `input_scale` None), or the
    static scalar; values past the float8 range saturate."""
    values = x.to(torch.float32)
    if input_scale is None:
        scale = values.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_ACTIVATION_SCALE) / FP8_MAX
    else:
        scale = input_scale
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.contiguous(), scale  # _scaled_mm takes a row-major left operand


@dataclass(slots=True)
class Fp8Linear:
    """One rank's slice of a linear weight, in fp8, with what its GEMM needs."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn, row-major (its transpose is column-major)
    weight_scale: torch.Tensor  # float32: [] per tensor, or [1, out] per output channel
    input_scale: torch.Tensor | None  # float32 []: a static activation scale; None: per token
    out_dtype: torch.dtype  # the compute dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def tensors(self) -> list[torch.Tensor]:
        scales = [self.weight_scale] + ([] if self.input_scale is None else [self.input_scale])
        return [self.weight, *scales]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ the weight^T (+ bias [out]): [T, out] in the compute dtype."""
        x_fp8, x_scale = quantize_activations(x, self.input_scale)
        if x_scale.dim() == 0 and self.weight_scale.dim() == 0:  # both per tensor
            out = torch._scaled_mm(
                x_fp8,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                out_dtype=self.out_dtype,
            )
        elif self.out_dtype == ROWWISE_OUT_DTYPE:  # both per row, the scales in the epilogue
            num_tokens, num_out = x_fp8.shape[0], self.weight.shape[0]
            out = torch._scaled_mm(
                x_fp8,
                self.weight.t(),
                scale_a=x_scale.expand(num_tokens, 1).contiguous(),
                scale_b=self.weight_scale.expand(1, num_out).contiguous(),
                out_dtype=ROWWISE_OUT_DTYPE,
            )
        else:  # float32 or float16 out: unit scales, float32 out, then both scales
            one = torch.ones((), dtype=torch.float32, device=x.device)
            out = torch._scaled_mm(
                x_fp8, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            )
            out = (out * x_scale * self.weight_scale).to(self.out_dtype)
        return out if bias is None else out + bias


def weight_tensors(weight: "torch.Tensor | Fp8Linear") -> list[torch.Tensor]:
    """The tensors a linear weight holds: itself, or an Fp8Linear's weight and scales."""
    return weight.tensors() if isinstance(weight, Fp8Linear) else [weight]


def merged_weight_scale(
    scales: list[torch.Tensor], rows: list[slice], num_rows: list[int]
) -> torch.Tensor:
    """The float32 scale of a weight merged from parts: each part's per-tensor scale, or its
    per-channel scales cut to `rows` (the part's whole tensor has `num_rows` rows). One part with
    one scale stays a scalar; anything else is [1, out], one per merged row."""
    if len(scales) == 1 and scales[0].numel() == 1:
        return scales[0].to(torch.float32).reshape(())
    pieces = []
    for scale, part_rows, total in zip(scales, rows, num_rows, strict=True):
        scale = scale.to(torch.float32).reshape(-1)
        whole = scale.expand(total) if scale.numel() == 1 else scale
        pieces.append(whole[part_rows])
    return torch.cat(pieces).reshape(1, -1)
