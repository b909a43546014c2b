"""GGUF files (`--model FILE.gguf`): the config and the weights llama.cpp's format carries, read
with the `gguf` library.

A GGUF file holds what a checkpoint folder spreads over config.json, the safetensors files and the
tokenizer: metadata under llama.cpp's key names (`llama.embedding_length`, `tokenizer.ggml.tokens`,
...) and tensors under its own names (`blk.0.attn_q.weight`), most of them quantized in blocks
along each row (Q8_0: 32 values in 34 bytes; Q4_K: 256 values in 144 bytes).

- The config is rebuilt as config.json would state it (`gguf_raw_config`), then read by
  config.py like any other, so every refusal names its field the same way.
- Tensors are found under their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`), so
  checkpoint.py checks and weights.py loads them as it does safetensors.
- Each rank dequantizes only its own slices: rows are cut out of the quantized bytes before
  dequantizing (a row is whole blocks), and columns too when the cut falls on block boundaries;
  otherwise the rank's rows are dequantized whole and the columns cut from them.
- llama.cpp stores a llama's q and k rows permuted within each head (its rotary pairs adjacent
  halves differently); they are put back in Hugging Face's order as they are read, head by head,
  so a rank's whole heads need nothing of another's.
- Dequantization is the `gguf` library's (its numpy kernels); a tensor type it cannot dequantize
  is refused at the check, naming the tensor and its type.

Never imports torch, so deploy/ can check a file cheaply.
"""

import functools
from collections.abc import Iterable
from pathlib import Path

import numpy as np

GGUF_SUFFIX = ".gguf"
# general.architecture -> the transformers architecture its tensors and metadata describe
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")  # norms stored as 1 + weight
GEMMA_NORM_OFFSET = 1.0  # llama.cpp stores Gemma's norm weights with the 1 of (1 + weight) added
# The ggml types read: plain floats, and the quantized types the gguf library dequantizes
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma's sandwich norms: after the attention, and before and after the MLP
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3's fused tensors: q, k, v rows in one; gate, then up rows in ffn_up
_PHI3_LAYER_NAMES = _LAYER_NAMES | {
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
_QWEN3MOE_LAYER_NAMES = _LAYER_NAMES | {"mlp.gate.weight": "ffn_gate_inp.weight"}
_LAYER_NAMES_OF = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
    "qwen3moe": _QWEN3MOE_LAYER_NAMES,
}
# A mixture of experts' tensors stack every expert: [experts, rows, cols], one per projection
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
}
_MODEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PREFIX = "model.layers."
# Phi-3's longrope factors: tensors in the file, config fields in transformers' terms
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# What a model's shape cannot do without; the rest has llama.cpp's defaults
REQUIRED_KEYS = (
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.head_count",
    "context_length",
)


class GGUFError(ValueError):
    """A GGUF file kvserve cannot serve; the message names the key or tensor."""


def is_gguf(model: str) -> bool:
    """Whether `--model` names a GGUF file."""
    path = Path(model)
    return path.suffix == GGUF_SUFFIX and path.is_file()


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
    """The file's reader (memory-mapped; tensors are read on first use)."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"cannot read {path} as a GGUF file: {exc}") from None


def metadata(path: str, key: str, default: object = None) -> object:
    """One metadata value (a number, a string, a list), or `default` when the file has none."""
    field = open_gguf(path).fields.get(key)
    return default if field is None else field.contents()


def gguf_name(hf_name: str, architecture: str = "llama") -> tuple[str, int | None] | None:
    """llama.cpp's name of a Hugging Face tensor name in a file of `architecture`, with the
    expert's index where the file stacks experts in one tensor; None for a name it has no tensor
    for."""
    if hf_name in _MODEL_NAMES:
        return _MODEL_NAMES[hf_name], None
    if not hf_name.startswith(_LAYER_PREFIX):
        return None
    index, _, rest = hf_name.removeprefix(_LAYER_PREFIX).partition(".")
    if not index.isdigit():
        return None
    expert, _, projection = rest.removeprefix("mlp.experts.").partition(".")
    if rest.startswith("mlp.experts.") and expert.isdigit():
        local = _EXPERT_NAMES.get(projection.removesuffix(".weight"))
        return None if local is None else (f"blk.{index}.{local}", int(expert))
    local = _LAYER_NAMES_OF.get(architecture, _LAYER_NAMES).get(rest)
    return None if local is None else (f"blk.{index}.{local}", None)


def hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """Every llama.cpp tensor name this module reads (but stacked experts), to its Hugging Face
    name."""
    names = {ours: hf for hf, ours in _MODEL_NAMES.items()}
    layer_names = _LAYER_NAMES_OF.get(architecture, _LAYER_NAMES)
    for i in range(num_layers):
        names |= {f"blk.{i}.{gguf}": f"{_LAYER_PREFIX}{i}.{hf}" for hf, gguf in layer_names.items()}
    return names


def gguf_raw_config(path: str) -> dict:
    """The file's metadata as the config.json of the same model would state it."""
    reader = open_gguf(path)
    architecture = metadata(path, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(
            f"{path} general.architecture={architecture!r}: expected one of {list(ARCHITECTURES)}"
        )
    tokens = metadata(path, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path} has no tokenizer.ggml.tokens: expected the model's vocabulary")
    names = {tensor.name for tensor in reader.tensors}

    def key(name: str, default: object = None) -> object:
        return metadata(path, f"{architecture}.{name}", default)

    for name in REQUIRED_KEYS:
        if key(name) is None:
            raise GGUFError(f"{path} has no {architecture}.{name}: expected the model's {name}")

    hidden, heads = key("embedding_length"), key("attention.head_count")
    raw = {
        "architectures": [ARCHITECTURES[architecture]],
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": metadata(path, "tokenizer.ggml.eos_token_id"),
        "dtype": "float32",  # dequantized at load; --dtype picks another
    }
    head_dim = key("attention.key_length")
    if head_dim is not None:
        raw["head_dim"] = head_dim
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif scaling != "none":
        raise GGUFError(
            f"{path} {architecture}.rope.scaling.type={scaling!r}: expected 'none' or 'linear'"
        )
    raw |= _family_config(architecture, key, raw)
    if architecture == "phi3" and names & set(LONGROPE_TENSORS):
        raw |= _phi3_longrope(path, key)
    return {name: value for name, value in raw.items() if value is not None}


def _family_config(architecture: str, key, raw: dict) -> dict:
    """The config fields one family's metadata carries beyond the common ones, with llama.cpp's
    values where the file states none."""
    if architecture in GEMMA_ARCHITECTURES:
        fields = {
            "sliding_window": key("attention.sliding_window"),
            "final_logit_softcapping": key("final_logit_softcapping"),
        }
        if architecture == "gemma2":
            fields["attn_logit_softcapping"] = key("attn_logit_softcapping")
        else:  # Gemma 3: every 6th layer global, the sliding ones at theta 10000 (llama.cpp's)
            fields["sliding_window_pattern"] = key("attention.sliding_window_pattern")
        return fields
    if architecture == "phi3":
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        rotated = key("rope.dimension_count", head_dim)
        return {
            "partial_rotary_factor": rotated / head_dim,
            "sliding_window": key("attention.sliding_window"),
        }
    if architecture == "qwen3moe":
        return {
            "num_experts": key("expert_count"),
            "num_experts_per_tok": key("expert_used_count"),
            "moe_intermediate_size": key("expert_feed_forward_length"),
            # llama.cpp and transformers' GGUF reader both renormalise Qwen3-MoE's top-k weights
            "norm_topk_prob": True,
        }
    return {}


def _phi3_longrope(path: str, key) -> dict:
    """Phi-3's longrope as config.json states it: llama.cpp keeps the long and short factors as
    tensors, the pretraining context and the attention factor as metadata."""
    tensors = _tensors_by_name(path)
    missing = [name for name in LONGROPE_TENSORS if name not in tensors]
    if missing:
        raise GGUFError(
            f"{path} has longrope factors but no {missing[0]}: expected both "
            f"{list(LONGROPE_TENSORS)}"
        )
    long_factor, short_factor = (
        [float(v) for v in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]
        for name in LONGROPE_TENSORS
    )
    original = key("rope.scaling.original_context_length")
    if original is None:
        raise GGUFError(
            f"{path} has longrope factors but no phi3.rope.scaling.original_context_length: "
            "expected the pretraining context"
        )
    scaling = {"type": "longrope", "long_factor": long_factor, "short_factor": short_factor}
    attention_factor = key("rope.scaling.attn_factor")
    if attention_factor is not None:
        scaling["attention_factor"] = attention_factor
    return {"rope_scaling": scaling, "original_max_position_embeddings": original}


def tensor_types(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the file by its Hugging Face name: (ggml type name, [rows, cols] shape).
    A stacked experts tensor [experts, rows, cols] is listed once per expert."""
    reader = open_gguf(path)
    architecture = str(metadata(path, "general.architecture"))
    names = hf_names(architecture, int(metadata(path, f"{architecture}.block_count")))
    found = {}
    for tensor in reader.tensors:
        if tensor.name in LONGROPE_TENSORS:
            continue  # read into the config (gguf_raw_config), not weights
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the row length first
        projection = tensor.name.rsplit(".", 2)[-2] if tensor.name.count(".") >= 2 else ""
        experts = {gguf: hf for hf, gguf in _EXPERT_NAMES.items()}
        if architecture == "qwen3moe" and f"{projection}.weight" in experts and len(shape) == 3:
            layer = tensor.name.split(".")[1]
            hf = experts[f"{projection}.weight"]
            for expert in range(shape[0]):
                name = f"{_LAYER_PREFIX}{layer}.mlp.experts.{expert}.{hf}.weight"
                found[name] = (tensor.tensor_type.name, shape[1:])
            continue
        found[names.get(tensor.name, tensor.name)] = (tensor.tensor_type.name, shape)
    return found


def check_types(path: str, hf_tensor_names: Iterable[str]) -> None:
    """Refuse a tensor the model reads whose type cannot be dequantized, naming it and its type."""
    types = tensor_types(path)
    for name in hf_tensor_names:
        if name in types and types[name][0] not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {_gguf_name_of(path, name)} has type {types[name][0]}: expected "
                "one of "
                f"{list(SUPPORTED_TYPES)}"
            )


def read_tensor(
    path: str,
    hf_name: str,
    rows: slice | None = None,
    cols: slice | None = None,
    permuted_heads: int | None = None,
) -> np.ndarray:
    """Rows or columns of one tensor as float32, `[rows, cols]` as Hugging Face lays it out.

    `permuted_heads`: the tensor is a llama's q or k, stored by llama.cpp with each of its
    `permuted_heads` heads' rows permuted; `rows` must then cover whole heads.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    tensor, expert = _tensor(path, hf_name)
    qtype = GGMLQuantizationType(tensor.tensor_type)
    data = tensor.data if expert is None else tensor.data[expert]
    if data.ndim == 1:  # a vector: norms and biases, stored as floats
        part = np.array(data if rows is None else data[rows], dtype=np.float32)
        if metadata(path, "general.architecture") in GEMMA_ARCHITECTURES and tensor.name.endswith(
            "norm.weight"
        ):
            part -= GEMMA_NORM_OFFSET  # back to the weight of transformers' (1 + weight)
        return part
    num_rows = data.shape[0]
    row_part = slice(0, num_rows) if rows is None else rows
    row_len = int(tensor.shape[0])
    col_part = slice(0, row_len) if cols is None else cols
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    part = data[row_part]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(part[:, col_part], dtype=np.float32)
    elif col_part.start % block_values == 0 and col_part.stop % block_values == 0:
        start = col_part.start // block_values * block_bytes
        stop = col_part.stop // block_values * block_bytes
        values = quants.dequantize(np.ascontiguousarray(part[:, start:stop]), qtype)
    else:
        values = quants.dequantize(np.ascontiguousarray(part), qtype)[:, col_part]
    values = np.array(values, dtype=np.float32)  # a copy: the file's pages are read-only
    if permuted_heads is not None:
        head_rows = num_rows // permuted_heads
        values = _unpermute(values, values.shape[0] // head_rows)
    return values


def _unpermute(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's two rotary halves; put them back one after the other."""
    rows, cols = values.shape
    half = rows // num_heads // 2
    return values.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


@functools.lru_cache(maxsize=4)
def _tensors_by_name(path: str) -> dict:
    return {tensor.name: tensor for tensor in open_gguf(path).tensors}


def _gguf_name_of(path: str, hf_name: str) -> str | None:
    found = gguf_name(hf_name, str(metadata(path, "general.architecture")))
    return None if found is None else found[0]


def _tensor(path: str, hf_name: str):
    """The file's tensor holding `hf_name`, and the expert's index where it stacks experts."""
    found = gguf_name(hf_name, str(metadata(path, "general.architecture")))
    tensor = None if found is None else _tensors_by_name(path).get(found[0])
    if tensor is None:
        raise GGUFError(f"{path} has no tensor {found and found[0]} (for {hf_name})")
    return tensor, found[1]
