"""HFConfig: what the decoder needs of a checkpoint's config.json (and generation_config.json),
read and refused here with a CheckpointError naming the field, before any rank allocates.

Both spellings of rotary settings are read: the hub's top-level `rope_theta`/`rope_scaling` and
transformers 5's `rope_parameters`. Never imports torch, so deploy/ can check a folder cheaply.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from worker.models.hf.gguf_file import GGUFError, gguf_raw_config, is_gguf
from worker.models.hf.moe_config import (
    MOE_ARCHITECTURES,
    MoeConfig,
    MoeConfigError,
    read_moe_config,
)
from worker.models.hf.quantization import Fp8Scheme, QuantizationError, read_quantization

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
PHI3_FAMILY = ("Phi3ForCausalLM",)
ARCHITECTURES = LLAMA_FAMILY + MOE_ARCHITECTURES + GEMMA_FAMILY + PHI3_FAMILY
# every layer windowed alike by one top-level sliding_window (Qwen3-MoE: with use_sliding_window)
WHOLE_MODEL_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
GEMMA_ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with the tanh approximation of GELU
# Gemma 3's thetas when config.json names none: the global layers', then the sliding layers'
GEMMA3_DEFAULT_THETA, GEMMA3_DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0
GEMMA3_DEFAULT_SLIDING_PATTERN = 6  # every 6th layer global, when neither layer_types is given
ROPE_TYPES_WITH_ORIGINAL_LEN = ("llama3", "yarn", "longrope")  # default: max_position_embeddings
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_ROPE_THETA = 10000.0  # every supported architecture's default
DEFAULT_RMS_NORM_EPS = 1e-6


class CheckpointError(ValueError):
    """A checkpoint this worker cannot serve; the message names the field or tensor."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str  # one of ROPE_TYPES
    theta: float
    factor: float = 1.0  # linear, llama3 and yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3 and yarn: the pretraining context
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: scales cos and sin; None derives it
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards
    partial_rotary_factor: float = 1.0  # the leading share of each head that rotates (Phi-3)
    short_factor: tuple[float, ...] = ()  # longrope: divides each frequency up to the original
    long_factor: tuple[float, ...] = ()  # longrope: divides each frequency past it


@dataclass(frozen=True, slots=True)
class HFConfig:
    """One checkpoint's decoder shape, in the checkpoint's own terms (whole model, before TP)."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_o_bias: bool
    has_mlp_bias: bool
    has_qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before rotary
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer: tokens read, the current one included
    dtype: str  # the checkpoint's torch_dtype (float32 when it names none)
    eos_token_ids: tuple[int, ...]
    quantization: Fp8Scheme | None = None  # fp8 weights and how their scales are stored
    moe: MoeConfig | None = None  # the experts of Qwen3-MoE and Mixtral; None: dense MLPs only
    # Family fields (their defaults are the Llama family's):
    hidden_act: str = "silu"  # the gate's activation: "silu", or GEMMA_ACTIVATION
    gemma_norms: bool = False  # (1 + weight) RMSNorms, sandwich norms, embeddings * sqrt(D)
    attention_scale: float | None = None  # on q k^T; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise (Gemma 2 and 3)
    sliding_rope: RopeConfig | None = None  # the sliding layers' rope, where it differs (Gemma 3)
    fused_qkv_gate_up: bool = False  # qkv_proj and gate_up_proj tensors (Phi-3)


def is_checkpoint(model: str) -> bool:
    """Whether `--model` names a folder holding config.json, or a GGUF file, rather than a
    built-in model."""
    return (Path(model) / "config.json").is_file() or is_gguf(model)


def _read_json(path: Path) -> dict:
    try:
        with path.open() as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds {type(data).__name__}, expected a JSON object")
    return data


def _int(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def _number(raw: dict, key: str, default: float | None = None, where: str = "config.json") -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{where} {key}={value!r}: expected a finite number")
    return float(value)


def read_hf_config(path: str) -> HFConfig:
    """Parse and check the folder's config.json; CheckpointError on anything unsupported."""
    folder = Path(path)
    raw = _gguf_raw_config(path) if is_gguf(path) else _read_json(folder / "config.json")
    architecture = _architecture(raw)
    hidden_size, num_heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    num_layers = _int(raw, "num_hidden_layers")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    num_kv_heads = _int(raw, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"config.json num_key_value_heads={num_kv_heads}: expected a divisor of "
            f"num_attention_heads={num_heads}"
        )
    is_llama = architecture == "LlamaForCausalLM"
    is_qwen3 = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    attention_bias = bool(raw.get("attention_bias", False)) and architecture not in (
        "MistralForCausalLM",
        "MixtralForCausalLM",
    )
    try:
        moe = read_moe_config(raw, architecture, num_layers)
    except MoeConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if architecture in GEMMA_FAMILY:
        family = _gemma_fields(raw, architecture, num_layers)
    elif architecture in PHI3_FAMILY:
        family = _phi3_fields(raw, num_layers)
        attention_bias = False  # Phi-3's projections carry no biases
    else:
        family = dict(
            rope=_rope(raw), sliding_windows=_sliding_windows(raw, architecture, num_layers)
        )
    return HFConfig(
        path=path,
        architecture=architecture,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=_int({"head_dim": head_dim}, "head_dim"),
        rms_norm_eps=_number(raw, "rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and none on o; Llama and Qwen3 follow attention_bias
        has_qkv_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
        has_o_bias=attention_bias and architecture != "Qwen2ForCausalLM",
        has_mlp_bias=is_llama and bool(raw.get("mlp_bias", False)),
        has_qk_norm=is_qwen3 or architecture == "Gemma3ForCausalLM",
        dtype=_dtype(raw),
        eos_token_ids=_eos_token_ids(folder, raw),
        quantization=_quantization(raw),
        moe=moe,
        **family,
    )


def _architecture(raw: dict) -> str:
    """The one supported architecture config.json names, refusing non-SiLU ones."""
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise CheckpointError(
            f"config.json architectures={architectures!r}: expected one of {list(ARCHITECTURES)}"
        )
    if architectures[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"config.json architectures={architectures!r}: expected one of {list(ARCHITECTURES)}"
        )
    # Gemma reads hidden_activation (_gemma_fields checks it); the others gate with SiLU
    if architectures[0] not in GEMMA_FAMILY and raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={raw['hidden_act']!r}: expected 'silu'")
    return architectures[0]


def _gguf_raw_config(path: str) -> dict:
    try:
        return gguf_raw_config(path)
    except GGUFError as exc:
        raise CheckpointError(str(exc)) from None


def _quantization(raw: dict) -> Fp8Scheme | None:
    try:
        return read_quantization(raw)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None


def _rope(raw: dict) -> RopeConfig:
    """Merge rope_parameters (transformers 5) with rope_scaling (the hub's older spelling)."""
    params = dict(raw.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise CheckpointError(
            f"config.json rope_parameters has per-layer-type entries {sorted(params)}: expected "
            "one set of rotary parameters for every layer"
        )
    return _rope_from(_with_scaling(params, raw), raw, raw.get("rope_theta", DEFAULT_ROPE_THETA))


def _with_scaling(params: dict, raw: dict) -> dict:
    """`params` updated by rope_scaling, whose type (either spelling) wins over params'."""
    scaling = dict(raw.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling["type"]
    return {**params, **scaling}


def _rope_type(params: dict) -> str:
    """The rope type `params` names; rope_scaling's `type` is the hub's older spelling, and
    Phi-3's old names for longrope ("su", and "yarn" beside short/long factors) are longrope."""
    spellings = (params.get("rope_type"), params.get("type"))
    rope_type = next((name for name in spellings if name is not None), "default")
    if rope_type == "su" or (rope_type == "yarn" and "long_factor" in params):
        return "longrope"
    return rope_type


def _rope_from(
    params: dict, raw: dict, default_theta: float, partial_ok: bool = False
) -> RopeConfig:
    """One set of rotary parameters (already merged from the config's spellings) checked;
    `default_theta` where `params` names no rope_theta."""
    rope_type = _rope_type(params)
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(
            f"config.json rope type {rope_type!r}: expected one of {list(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not partial_ok:
        raise CheckpointError(f"config.json partial_rotary_factor={partial!r}: expected 1.0")
    partial = _number({"partial_rotary_factor": partial}, "partial_rotary_factor")
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(
            f"config.json partial_rotary_factor={partial!r}: expected a share in (0, 1]"
        )
    theta = _number(params, "rope_theta", default_theta, "rope")
    if rope_type == "default":
        return RopeConfig("default", theta, partial_rotary_factor=partial)
    where = f"rope {rope_type}"
    original = params.get("original_max_position_embeddings")
    if rope_type in ROPE_TYPES_WITH_ORIGINAL_LEN:
        # a top-level original_max_position_embeddings wins, as transformers reads it
        original = raw.get("original_max_position_embeddings", original)
        original = original or raw.get("max_position_embeddings")
    optional = {key: params.get(key) for key in ("attention_factor", "mscale", "mscale_all_dim")}
    for key, value in optional.items():
        if value is not None:
            optional[key] = _number(params, key, where=where)
    factors: dict = {}
    if rope_type == "longrope":
        # factor defaults to how far max_position_embeddings stretches the pretraining context
        factor = _number(params, "factor", raw["max_position_embeddings"] / original, where)
        factors = {key: _factor_list(params, key) for key in ("short_factor", "long_factor")}
    else:
        factor = _number(params, "factor", where=where)
    return RopeConfig(
        rope_type,
        theta,
        factor=factor,
        low_freq_factor=_number(params, "low_freq_factor", 1.0, where),
        high_freq_factor=_number(params, "high_freq_factor", 4.0, where),
        original_max_position_embeddings=int(original or 0),
        beta_fast=_number(params, "beta_fast", 32.0, where),
        beta_slow=_number(params, "beta_slow", 1.0, where),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
        **optional,
        **factors,
    )


def _factor_list(params: dict, key: str) -> tuple[float, ...]:
    values = params.get(key)
    if not isinstance(values, list) or not values:
        raise CheckpointError(f"config.json rope longrope {key}={values!r}: expected a list")
    return tuple(_number({key: v}, key, where="rope longrope") for v in values)


def _sliding_windows(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Mistral's and Mixtral's window covers every layer, and Qwen3-MoE's with
    use_sliding_window; Qwen2/Qwen3 window the layers layer_types names sliding_attention (by
    default those from max_window_layers on, with use_sliding_window)."""
    window = _window(raw)
    if architecture in WHOLE_MODEL_WINDOW_ARCHITECTURES:
        return (window,) * num_layers
    if architecture == "LlamaForCausalLM":
        return (None,) * num_layers
    if not raw.get("use_sliding_window", False):
        window = None  # Qwen2/Qwen3 ignore the window unless use_sliding_window is set
    if architecture == "Qwen3MoeForCausalLM":  # no layer_types: the window is every layer's
        return (window,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = raw.get("max_window_layers", num_layers)
        layer_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    return _windows_of_layer_types(raw, layer_types, window, num_layers)


def _windows_of_layer_types(
    raw: dict, layer_types: object, window: int | None, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window: `window` for sliding_attention layers, None for full ones."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CheckpointError(
            f"config.json layer_types={layer_types!r}: expected {num_layers} entries"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise CheckpointError(
            f"config.json layer_types has {unknown}: expected only {list(LAYER_TYPES)}"
        )
    if "sliding_attention" in layer_types and window is None:
        raise CheckpointError(
            "config.json layer_types names sliding_attention layers but the sliding window is "
            f"off (sliding_window={raw.get('sliding_window')!r}, use_sliding_window="
            f"{raw.get('use_sliding_window')!r}): expected both set"
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _window(raw: dict, default: int | None = None) -> int | None:
    window = raw.get("sliding_window", default)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise CheckpointError(f"config.json sliding_window={window!r}: expected null or >= 1")
    return window


def _optional_number(raw: dict, key: str, default: float | None) -> float | None:
    """raw[key] as a positive number, `default` when absent; an explicit null is None."""
    if key not in raw:
        return default
    if raw[key] is None:
        return None
    value = _number(raw, key)
    if value <= 0:
        raise CheckpointError(f"config.json {key}={value!r}: expected null or a positive number")
    return value


def _gemma_fields(raw: dict, architecture: str, num_layers: int) -> dict:
    """Gemma 2 and Gemma 3 (text): GeGLU, (1 + weight) sandwich norms, query_pre_attn_scalar,
    soft-capping, and sliding layers by layer_types (defaults as transformers derives them:
    Gemma 2 alternates from a sliding first layer, Gemma 3 makes every 6th layer global)."""
    is_gemma2 = architecture == "Gemma2ForCausalLM"
    activation = raw.get("hidden_activation") or GEMMA_ACTIVATION
    if activation != GEMMA_ACTIVATION:
        raise CheckpointError(
            f"config.json hidden_activation={activation!r}: expected {GEMMA_ACTIVATION!r}"
        )
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"config.json use_bidirectional_attention={raw['use_bidirectional_attention']!r}: "
            "expected false (a causal decoder)"
        )
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = 2 if is_gemma2 else raw.get("sliding_window_pattern")
        pattern = _int({"sliding_window_pattern": pattern}, "sliding_window_pattern", 6)
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    scalar = _number(raw, "query_pre_attn_scalar", 256)
    if scalar <= 0:
        raise CheckpointError(f"config.json query_pre_attn_scalar={scalar!r}: expected > 0")
    if is_gemma2:
        rope, sliding_rope = _rope(raw), None
    else:
        rope, sliding_rope = _gemma3_ropes(raw)
    return dict(
        rope=rope,
        sliding_windows=_windows_of_layer_types(raw, layer_types, _window(raw, 4096), num_layers),
        hidden_act=GEMMA_ACTIVATION,
        gemma_norms=True,
        attention_scale=scalar**-0.5,
        # Gemma 3's attention reads no attn_logit_softcapping (transformers ignores the field)
        attn_softcap=_optional_number(raw, "attn_logit_softcapping", 50.0) if is_gemma2 else None,
        final_softcap=_optional_number(raw, "final_logit_softcapping", 30.0 if is_gemma2 else None),
        sliding_rope=sliding_rope,
    )


def _gemma3_ropes(raw: dict) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's global and sliding ropes: transformers 5's rope_parameters by layer type, or the
    hub's rope_theta (global), rope_local_base_freq (sliding) and rope_scaling (global only)."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(
        kind not in LAYER_TYPES or not isinstance(entry, dict | None)
        for kind, entry in params.items()
    ):
        raise CheckpointError(
            f"config.json rope_parameters={params!r}: expected an entry per layer type "
            f"{list(LAYER_TYPES)}"
        )
    full = _with_scaling(dict(params.get("full_attention") or {}), raw)
    sliding = dict(params.get("sliding_attention") or {})
    full_theta = raw.get("rope_theta", GEMMA3_DEFAULT_THETA)
    sliding_theta = raw.get("rope_local_base_freq", GEMMA3_DEFAULT_LOCAL_THETA)
    return _rope_from(full, raw, full_theta), _rope_from(sliding, raw, sliding_theta)


def _phi3_fields(raw: dict, num_layers: int) -> dict:
    """Phi-3: fused qkv_proj and gate_up_proj tensors, partial rotary, longrope, and a window
    (when sliding_window is set) on every layer."""
    hidden_size, num_heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    # transformers reads rope_scaling, else rope_parameters, never the two merged
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope = _rope_from(params, raw, raw.get("rope_theta", DEFAULT_ROPE_THETA), partial_ok=True)
    if rope.rope_type not in ("default", "longrope"):
        raise CheckpointError(
            f"config.json rope type {rope.rope_type!r}: expected 'default' or 'longrope' for "
            "Phi3ForCausalLM"
        )
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(
            f"config.json partial_rotary_factor={rope.partial_rotary_factor!r}: rotates "
            f"{rotary_dim} of head_dim={head_dim} dimensions, expected an even number >= 2"
        )
    for key in ("short_factor", "long_factor") if rope.rope_type == "longrope" else ():
        if len(getattr(rope, key)) != rotary_dim // 2:
            raise CheckpointError(
                f"config.json rope longrope {key} has {len(getattr(rope, key))} entries: "
                f"expected rotary_dim / 2 = {rotary_dim // 2}"
            )
    return dict(rope=rope, sliding_windows=(_window(raw),) * num_layers, fused_qkv_gate_up=True)


def _dtype(raw: dict) -> str:
    dtype = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"config.json dtype={dtype!r}: expected one of {list(DTYPES)}")
    return dtype


def _eos_token_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an int or a list), else config.json's."""
    value = raw.get("eos_token_id")
    where = "config.json"
    generation = folder / "generation_config.json"
    if generation.is_file():
        generation_value = _read_json(generation).get("eos_token_id")
        if generation_value is not None:
            value, where = generation_value, "generation_config.json"
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{where} eos_token_id={value!r}: expected an id or a list of ids")
    return tuple(dict.fromkeys(ids))  # every id once, in the order given
