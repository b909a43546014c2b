"""FP8 weight checkpoints: which quantization_config kvserve reads, and dequantizing its weights.

Two producers write float8 (e4m3) linear weights with float32 scales beside them, and both are
read here:
- `quant_method: "fp8"`: transformers' FineGrainedFP8 (and the official Qwen3 / DeepSeek FP8
  releases) stores `<module>.weight_scale_inv` per `weight_block_size` block (128 x 128,
  typically); vLLM's older fp8 export (AutoFP8) stores `<module>.weight_scale`, one per tensor.
- `quant_method: "compressed-tensors"` (llm-compressor) with a config group whose weights are
  8-bit floats stores `<module>.weight_scale`, one per tensor or one per output channel.

A weight's real value is `fp8 * scale`, the scale broadcast over its block, channel or tensor.
Which linear weights are quantized is read from the safetensors headers (dtype F8_E4M3), so the
`ignore` / `modules_to_not_convert` lists need no interpretation: a module left in float is
simply a float tensor.

The activation scheme says how the checkpoint meant activations to be quantized: `dynamic` (a
scale per token, computed as it runs) or `static` (one `<module>.input_scale` per tensor,
calibrated); none for weight-only checkpoints. On CUDA devices with FP8 (compute capability 8.9
and up) per-tensor and per-channel weights stay in fp8 and multiply activations quantized that
way with `torch._scaled_mm` (fp8_linear.py). Everywhere else, and for block-wise scales or
weight-only checkpoints, weights are dequantized at load to the compute dtype and activations
stay float (`input_scale` is then read past).

Never imports torch at module level, so deploy/ can check a folder cheaply.
"""

import math
from dataclasses import dataclass

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16")
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".output_scale")  # read only by a static fp8 path
ACTIVATION_SCHEMES = ("dynamic", "static")  # a scale per token, as it runs; one per tensor, stored


class QuantizationError(ValueError):
    """A quantization_config kvserve cannot serve; the message names the field."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How one checkpoint's fp8 weights carry their scales."""

    quant_method: str  # "fp8" or "compressed-tensors"
    scale_suffix: str  # "weight_scale_inv" (block-wise) or "weight_scale"
    block: tuple[int, int] | None  # (rows, cols) of a block-wise scale; None: tensor or channel
    activation_scheme: str | None = None  # one of ACTIVATION_SCHEMES; None: weight-only

    def scale_name(self, weight_name: str) -> str:
        """`model.layers.0.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight_scale`."""
        return weight_name.removesuffix("weight") + self.scale_suffix

    def input_scale_name(self, weight_name: str) -> str:
        """`...up_proj.weight` -> `...up_proj.input_scale` (static activation schemes)."""
        return weight_name.removesuffix("weight") + "input_scale"

    def scale_shapes(self, weight_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The scale shapes accepted for a weight of `weight_shape` ([out, in])."""
        rows, cols = weight_shape
        if self.block is not None:
            return [(math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))]
        return [(), (1,), (1, 1), (rows,), (rows, 1)]


def read_quantization(raw: dict) -> Fp8Scheme | None:
    """config.json's quantization_config as an Fp8Scheme; None when there is none."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise QuantizationError(
            f"config.json quantization_config={config!r}: expected an object with a quant_method"
        )
    method = config.get("quant_method")
    if method == "fp8":
        return _fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise QuantizationError(
        f"config.json quantization_config quant_method={method!r}: expected 'fp8' or "
        "'compressed-tensors' (float8 weights); other quantized safetensors are not supported "
        "(GGUF files are, with --model FILE.gguf)"
    )


def _fp8(config: dict) -> Fp8Scheme:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"config.json quantization_config fmt={fmt!r}: expected 'e4m3'")
    activation = config.get("activation_scheme", "dynamic")  # transformers' default
    if activation not in ACTIVATION_SCHEMES:
        raise QuantizationError(
            f"config.json quantization_config activation_scheme={activation!r}: expected one of "
            f"{list(ACTIVATION_SCHEMES)}"
        )
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "weight_scale", None, activation)
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise QuantizationError(
            f"config.json quantization_config weight_block_size={block!r}: expected two positive "
            "integers"
        )
    return Fp8Scheme("fp8", "weight_scale_inv", (block[0], block[1]), activation)


def _compressed_tensors(config: dict) -> Fp8Scheme:
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(
            f"config.json quantization_config config_groups={groups!r}: expected at least one group"
        )
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise QuantizationError(
                f"config.json quantization_config config_groups.{name}.weights={weights!r}: "
                "expected an object"
            )
        kind = (weights.get("num_bits"), weights.get("type"))
        if kind != (8, "float"):
            raise QuantizationError(
                f"config.json quantization_config config_groups.{name}.weights "
                f"num_bits={kind[0]!r} type={kind[1]!r}: expected 8-bit float weights (other "
                "compressed-tensors "
                "schemes are not supported)"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise QuantizationError(
                f"config.json quantization_config config_groups.{name}.weights "
                f"strategy={strategy!r}: expected 'tensor' or 'channel'"
            )
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise QuantizationError(
            f"config.json quantization_config format={fmt!r}: expected 'float-quantized'"
        )
    activations = {_activation_scheme(name, g) for name, g in groups.items()}
    if len(activations) > 1:
        raise QuantizationError(
            f"config.json quantization_config config_groups quantize activations "
            f"{sorted(map(str, activations))}: expected one scheme for every group"
        )
    return Fp8Scheme("compressed-tensors", "weight_scale", None, activations.pop())


def _activation_scheme(name: str, group: dict) -> str | None:
    """A compressed-tensors group's input_activations: dynamic (per token), static (a stored
    scale per tensor), or None (weight-only)."""
    activations = group.get("input_activations")
    if activations is None:
        return None
    where = f"config.json quantization_config config_groups.{name}.input_activations"
    kind = (activations.get("num_bits"), activations.get("type"))
    if kind != (8, "float"):
        raise QuantizationError(
            f"{where} num_bits={kind[0]!r} type={kind[1]!r}: expected 8-bit float activations"
        )
    if activations.get("dynamic"):
        return "dynamic"
    strategy = activations.get("strategy", "tensor")
    if strategy != "tensor":
        raise QuantizationError(
            f"{where} strategy={strategy!r} with dynamic false: expected 'tensor' (a static "
            "scale per tensor)"
        )
    return "static"


def is_activation_scale(tensor: str) -> bool:
    return tensor.endswith(ACTIVATION_SCALE_SUFFIXES)


def dequantize(weight, scale, block: tuple[int, int] | None, rows: slice, cols: slice):
    """`weight` (this rank's fp8 rows/cols of a [out, in] tensor) times its scales, in float32.

    `scale` is the whole tensor's scale; `rows` and `cols` say which part of the whole weight
    `weight` is, so the matching scales are picked (a block scale repeats over its block).
    """
    import torch

    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    num_rows, num_cols = values.shape
    if block is not None:
        row_ids = torch.arange(rows.start, rows.start + num_rows) // block[0]
        col_ids = torch.arange(cols.start, cols.start + num_cols) // block[1]
        return values * scale[row_ids][:, col_ids]
    if scale.numel() == 1:
        return values * scale.reshape(())
    return values * scale.reshape(-1)[rows].reshape(-1, 1)
