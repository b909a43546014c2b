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
}
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
_MODEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PREFIX = "model.layers."
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


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name of a Hugging Face tensor name; None for a name it has no tensor for."""
    if hf_name in _MODEL_NAMES:
        return _MODEL_NAMES[hf_name]
    if not hf_name.startswith(_LAYER_PREFIX):
        return None
    index, _, rest = hf_name.removeprefix(_LAYER_PREFIX).partition(".")
    local = _LAYER_NAMES.get(rest)
    return None if local is None or not index.isdigit() else f"blk.{index}.{local}"


def hf_names(num_layers: int) -> dict[str, str]:
    """Every llama.cpp tensor name this module reads, to its Hugging Face name."""
    names = {ours: hf for hf, ours in _MODEL_NAMES.items()}
    for i in range(num_layers):
        names |= {
            f"blk.{i}.{gguf}": f"{_LAYER_PREFIX}{i}.{hf}" for hf, gguf in _LAYER_NAMES.items()
        }
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
    return {name: value for name, value in raw.items() if value is not None}


def tensor_types(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the file by its Hugging Face name: (ggml type name, [rows, cols] shape)."""
    reader = open_gguf(path)
    names = hf_names(int(metadata(path, f"{metadata(path, 'general.architecture')}.block_count")))
    found = {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the row length first
        found[names.get(tensor.name, tensor.name)] = (tensor.tensor_type.name, shape)
    return found


def check_types(path: str, hf_tensor_names: Iterable[str]) -> None:
    """Refuse a tensor the model reads whose type cannot be dequantized, naming it and its type."""
    types = tensor_types(path)
    for name in hf_tensor_names:
        if name in types and types[name][0] not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {gguf_name(name)} has type {types[name][0]}: expected one of "
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

    tensor = _tensor(path, hf_name)
    qtype = GGMLQuantizationType(tensor.tensor_type)
    data = tensor.data
    if data.ndim == 1:  # a vector: norms and biases, stored as floats
        part = data if rows is None else data[rows]
        return np.array(part, dtype=np.float32)
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


def _tensor(path: str, hf_name: str):
    name = gguf_name(hf_name)
    tensor = _tensors_by_name(path).get(name)
    if tensor is None:
        raise GGUFError(f"{path} has no tensor {name} (for {hf_name})")
    return tensor
