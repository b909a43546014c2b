"""HFConfig: what the decoder needs of a checkpoint's config.json (and generation_config.json),
read and refused here with a CheckpointError naming the field, before any rank allocates.

This module reads what every architecture shares and the Llama family's fields (Llama, Qwen2,
Qwen3, Mistral); each other family's reader has its module: rope_config.py (rotary parameters,
either spelling), moe_config.py (experts), gemma_config.py, phi3_config.py, and gguf_file.py
rebuilds a GGUF file's config.json first. Never imports torch, so deploy/ can check a folder
cheaply.
"""

from dataclasses import dataclass
from pathlib import Path

from worker.models.hf.gemma_config import GEMMA_FAMILY, gemma_fields
from worker.models.hf.gguf_file import GGUFError, gguf_raw_config, is_gguf
from worker.models.hf.moe_config import (
    MOE_ARCHITECTURES,
    MoeConfig,
    MoeConfigError,
    read_moe_config,
)
from worker.models.hf.phi3_config import PHI3_FAMILY, phi3_fields
from worker.models.hf.quantization import Fp8Scheme, QuantizationError, read_quantization
from worker.models.hf.raw_config import (
    CheckpointError,
    finite_number,
    positive_int,
    read_json,
    read_window,
    windows_of_layer_types,
)
from worker.models.hf.rope_config import RopeConfig, read_rope

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
ARCHITECTURES = LLAMA_FAMILY + MOE_ARCHITECTURES + GEMMA_FAMILY + PHI3_FAMILY
# every layer windowed alike by one top-level sliding_window (Qwen3-MoE: with use_sliding_window)
WHOLE_MODEL_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_RMS_NORM_EPS = 1e-6
__all__ = ["CheckpointError", "HFConfig", "RopeConfig", "is_checkpoint", "read_hf_config"]


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


def read_hf_config(path: str) -> HFConfig:
    """Parse and check the folder's config.json; CheckpointError on anything unsupported."""
    folder = Path(path)
    raw = _gguf_raw_config(path) if is_gguf(path) else read_json(folder / "config.json")
    architecture = _architecture(raw)
    hidden_size, num_heads = (
        positive_int(raw, "hidden_size"),
        positive_int(raw, "num_attention_heads"),
    )
    num_layers = positive_int(raw, "num_hidden_layers")
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    num_kv_heads = positive_int(raw, "num_key_value_heads", num_heads)
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
        family = gemma_fields(raw, architecture, num_layers)
    elif architecture in PHI3_FAMILY:
        family = phi3_fields(raw, num_layers)
        attention_bias = False  # Phi-3's projections carry no biases
    else:
        family = dict(
            rope=read_rope(raw), sliding_windows=_sliding_windows(raw, architecture, num_layers)
        )
    return HFConfig(
        path=path,
        architecture=architecture,
        vocab_size=positive_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=positive_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=positive_int({"head_dim": head_dim}, "head_dim"),
        rms_norm_eps=finite_number(raw, "rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        max_position_embeddings=positive_int(raw, "max_position_embeddings"),
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


def _sliding_windows(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Mistral's and Mixtral's window covers every layer, and Qwen3-MoE's with
    use_sliding_window; Qwen2/Qwen3 window the layers layer_types names sliding_attention (by
    default those from max_window_layers on, with use_sliding_window)."""
    window = read_window(raw)
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
    return windows_of_layer_types(raw, layer_types, window, num_layers)


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
        generation_value = read_json(generation).get("eos_token_id")
        if generation_value is not None:
            value, where = generation_value, "generation_config.json"
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{where} eos_token_id={value!r}: expected an id or a list of ids")
    return tuple(dict.fromkeys(ids))  # every id once, in the order given
