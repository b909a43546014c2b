"""Rotary position embeddings of a checkpoint: inverse frequencies for the default, linear,
llama3, yarn and longrope rope types, and each token's cos/sin from its position. With a partial
rotary factor (Phi-3) only the leading rotary_dim dimensions of each head rotate.

Computed in float32 from the positions of the step, as transformers computes them, then cast to
the compute dtype; nothing is tabled up to max_position_embeddings.
"""

import math

import torch

from worker.models.hf.rope_config import RopeConfig


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


def _longrope(rope: RopeConfig, head_dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE: each base frequency divided by its own factor (short or long)."""
    return _base_inv_freq(rope.theta, head_dim) / torch.tensor(factors, dtype=torch.float32)


def longrope_attention_factor(rope: RopeConfig) -> float:
    """The factor on cos and sin, for short and long factors alike: the configured one, else
    sqrt(1 + ln(factor) / ln(original context)) where the context is stretched."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading dimensions of each head rotate."""
    return int(head_dim * rope.partial_rotary_factor)


def uses_long_factors(rope: RopeConfig, max_model_len: int | None) -> bool:
    """Whether longrope rotates with its long factors: where a sequence may pass the original
    context (max_model_len beyond it). None: no sequence passes it."""
    return max_model_len is not None and max_model_len > rope.original_max_position_embeddings


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, max_model_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (float32) and the factor on cos and sin; `head_dim`
    is the rotated width (rotary_dim). Longrope's factor set is chosen by `max_model_len`
    (uses_long_factors; Rotary says why)."""
    match rope.rope_type:
        case "default":
            return _base_inv_freq(rope.theta, head_dim), 1.0
        case "linear":
            return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
        case "llama3":
            return _llama3_inv_freq(rope, _base_inv_freq(rope.theta, head_dim)), 1.0
        case "yarn":
            return _yarn(rope, head_dim)
        case "longrope":
            is_long = uses_long_factors(rope, max_model_len)
            factors = rope.long_factor if is_long else rope.short_factor
            return _longrope(rope, head_dim, factors), longrope_attention_factor(rope)
    raise ValueError(
        f"rope type {rope.rope_type!r}: expected default, linear, llama3, yarn or longrope"
    )


class Rotary:
    """cos and sin [T, rotary_dim] of a step's positions, and their rotation of q and k.

    Longrope has two factor sets and kvserve picks one for the whole deployment, at load: the
    long factors where max_model_len exceeds original_max_position_embeddings, the short ones
    otherwise (vLLM's rule since it stopped switching per batch). Every token of every sequence
    then rotates alike, so a cached prefix, a preempted request recomputed, or a chunked prefill
    gives the same K/V as one pass would.

    transformers picks per forward pass, by the longest sequence it computes: a prompt within the
    original context runs with the short factors and one past it with the long ones; and when a
    generated sequence first passes it, Phi-3's generate() drops the cache and recomputes the
    whole sequence with the long factors. So kvserve equals transformers exactly (a) whenever
    max_model_len <= original_max_position_embeddings (no sequence can pass it; short factors
    throughout), and (b) with a larger max_model_len, for every sequence once it is longer than
    the original context, a prompt past it from its first token. Equality is impossible by
    construction only for (b)'s sequences while they are still within the original context:
    there transformers rotates with the short factors and kvserve with the long ones, which it
    must since their K/V stay in the cache when the sequence grows past it (switching per token
    instead mixes two rotations in one cache, which real Phi-3 weights do not survive). Serve
    with --max-model-len at most original_max_position_embeddings for short-context fidelity.
    """

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        device: torch.device,
        max_model_len: int | None = None,  # the engine's; None: within the original context
    ) -> None:
        self.rotary_dim = rotary_dim(rope, head_dim)
        inv_freq, self.attention_factor = inverse_frequencies(rope, self.rotary_dim, max_model_len)
        self.inv_freq = inv_freq.to(device)  # [rotary_dim / 2] float32

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, rotary_dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]: both halves rotate alike
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its token's angles: the halves pair as (a, b) -> (-b, a).
    With cos and sin narrower than the head [T, rotary_dim], only its leading rotary_dim
    dimensions rotate and the rest pass through."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]
