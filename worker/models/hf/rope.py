"""Rotary position embeddings of a checkpoint: inverse frequencies for the default, linear,
llama3 and yarn rope types, and each token's cos/sin from its position.

Computed in float32 from the positions of the step, as transformers computes them, then cast to
the compute dtype; nothing is tabled up to max_position_embeddings.
"""

import math

import torch

from worker.models.hf.config import RopeConfig


def _base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)  # [head_dim / 2]


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    dimensions that turn beta_fast and beta_slow times over the pretraining context."""
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(rope.factor)
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        turns = original / (num_rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp  # 1 where a dimension keeps its pretraining frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (float32) and the factor on cos and sin."""
    match rope.rope_type:
        case "default":
            return _base_inv_freq(rope.theta, head_dim), 1.0
        case "linear":
            return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
        case "llama3":
            return _llama3_inv_freq(rope, _base_inv_freq(rope.theta, head_dim)), 1.0
        case "yarn":
            return _yarn(rope, head_dim)
    raise ValueError(f"rope type {rope.rope_type!r}: expected default, linear, llama3 or yarn")


class Rotary:
    """cos and sin [T, head_dim] of a step's positions, and their rotation of q and k."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        inv_freq, self.attention_factor = inverse_frequencies(rope, head_dim)
        self.inv_freq = inv_freq.to(device)  # [head_dim / 2] float32

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]: both halves rotate alike
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its token's angles: the halves pair as (a, b) -> (-b, a)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]
