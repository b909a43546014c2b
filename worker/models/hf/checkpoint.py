"""A checkpoint folder's tensors: which file holds each one (one file, several, or an index),
their dtypes and shapes from the safetensors headers alone, and the check that they are exactly
the tensors the config implies. `check_checkpoint` is what deploy/ runs before any process starts.

Reads headers only (8-byte length, then JSON); the weights themselves are read by weights.py.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from worker.models.hf.config import CheckpointError, HFConfig, read_hf_config
from worker.models.hf.gguf_file import GGUFError, check_types, is_gguf, tensor_types
from worker.models.hf.moe_config import moe_shapes
from worker.models.hf.quantization import FP8_DTYPE, SCALE_DTYPES, is_activation_scale

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_LENGTH_BYTES = 8  # a little-endian u64 before the JSON header
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the header
FLOAT_DTYPES = ("F32", "BF16", "F16")  # safetensors' names of the unquantized weight dtypes
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one .safetensors file, from its header."""
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(HEADER_LENGTH_BYTES))
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file} has a {length}-byte header, expected a safetensors")
            header = json.loads(stream.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read the safetensors header of {file}: {exc}") from None
    return {
        name: TensorEntry(file, entry["dtype"], tuple(entry["shape"]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def tensor_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint: through the index when there is one, else in
    model.safetensors, else in each *.safetensors file of the folder. A tensor in two files, or
    not in the file the index names, is refused. A GGUF file's tensors are named as Hugging Face
    names them, with their ggml type names (Q8_0, ...) as dtypes."""
    if is_gguf(str(folder)):
        return {
            name: TensorEntry(folder, dtype, shape)
            for name, (dtype, shape) in tensor_types(str(folder)).items()
        }
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        headers = {name: read_header(folder / name) for name in sorted(set(weight_map.values()))}
        entries = {}
        for tensor, file_name in weight_map.items():
            if tensor not in headers[file_name]:
                raise CheckpointError(
                    f"tensor {tensor}: {INDEX_FILE} names {file_name}, which lacks it"
                )
            entries[tensor] = headers[file_name][tensor]
        return entries
    entries = {}
    for file in weight_files(folder):
        for tensor, entry in read_header(file).items():
            if tensor in entries:
                raise CheckpointError(
                    f"tensor {tensor} is in both {entries[tensor].file.name} and {file.name}"
                )
            entries[tensor] = entry
    return entries


def weight_files(folder: Path) -> list[Path]:
    """The files the checkpoint's tensors are read from, as tensor_entries reads them: those
    the index names, else model.safetensors, else each *.safetensors file of the folder; a
    GGUF file is its own. CheckpointError when there is none or the index cannot be read."""
    if is_gguf(str(folder)):
        return [folder]
    index = folder / INDEX_FILE
    if index.is_file():
        return [folder / name for name in sorted(set(_weight_map(index).values()))]
    # model.safetensors alone when present: some repos ship other exports beside it (Mistral's
    # consolidated.safetensors holds the same weights under other names)
    single = folder / SINGLE_FILE
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors file (nor {INDEX_FILE})")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the weight_map of {index}: {exc}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) for name in weight_map.values()
    ):
        raise CheckpointError(f"the weight_map of {index} is not a map of tensor to file name")
    return weight_map


def expected_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """Each tensor name the config implies, with its whole-model shape (rows are outputs)."""
    dim, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, dim),
        "model.norm.weight": (dim,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, dim)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (dim,),
            layer + "post_attention_layernorm.weight": (dim,),
            layer + "self_attn.o_proj.weight": (dim, q_rows),
        }
        if config.fused_qkv_gate_up:  # Phi-3: q, k, v rows in one tensor
            shapes[layer + "self_attn.qkv_proj.weight"] = (q_rows + 2 * kv_rows, dim)
        else:
            shapes |= {
                layer + "self_attn.q_proj.weight": (q_rows, dim),
                layer + "self_attn.k_proj.weight": (kv_rows, dim),
                layer + "self_attn.v_proj.weight": (kv_rows, dim),
            }
        if config.moe is not None and config.moe.sparse_layers[i]:
            shapes |= moe_shapes(config.moe, i, dim)
        elif config.fused_qkv_gate_up:  # Phi-3: gate and up rows in one tensor
            shapes |= {
                layer + "mlp.gate_up_proj.weight": (2 * inter, dim),
                layer + "mlp.down_proj.weight": (dim, inter),
            }
        else:
            shapes |= {
                layer + "mlp.gate_proj.weight": (inter, dim),
                layer + "mlp.up_proj.weight": (inter, dim),
                layer + "mlp.down_proj.weight": (dim, inter),
            }
        if config.gemma_norms:  # Gemma's sandwich: norms before and after the MLP too
            shapes |= {
                layer + "pre_feedforward_layernorm.weight": (dim,),
                layer + "post_feedforward_layernorm.weight": (dim,),
            }
        if config.has_qkv_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_rows,),
                layer + "self_attn.k_proj.bias": (kv_rows,),
                layer + "self_attn.v_proj.bias": (kv_rows,),
            }
        if config.has_o_bias:
            shapes[layer + "self_attn.o_proj.bias"] = (dim,)
        if config.has_mlp_bias:
            shapes |= {
                layer + "mlp.gate_proj.bias": (inter,),
                layer + "mlp.up_proj.bias": (inter,),
                layer + "mlp.down_proj.bias": (dim,),
            }
        if config.has_qk_norm:
            shapes |= {
                layer + "self_attn.q_norm.weight": (hd,),
                layer + "self_attn.k_norm.weight": (hd,),
            }
    return shapes


def is_ignored(config: HFConfig, tensor: str) -> bool:
    """Tensors a checkpoint may carry that the model never reads: old rotary buffers, and
    lm_head when the embeddings are tied (the embedding matrix is the head)."""
    if tensor.endswith(IGNORED_SUFFIXES):
        return True
    if config.quantization is not None and is_activation_scale(tensor):
        return True
    return config.tie_word_embeddings and tensor == "lm_head.weight"


def check_tensors(config: HFConfig, entries: dict[str, TensorEntry]) -> None:
    """Exactly the expected tensors, each of its shape and an unquantized float dtype, or, in an
    fp8 checkpoint, a float8 matrix with its scale tensor beside it."""
    expected = expected_shapes(config)
    scales = _scale_shapes(config, entries, expected)
    expected = expected | scales
    missing = sorted(set(expected) - set(entries))
    if missing:
        raise CheckpointError(
            f"tensor {missing[0]} is missing ({len(missing)} missing in all): expected by "
            f"{config.architecture} with this config.json"
        )
    unexpected = sorted(t for t in set(entries) - set(expected) if not is_ignored(config, t))
    if unexpected:
        raise CheckpointError(
            f"tensor {unexpected[0]} is unexpected ({len(unexpected)} in all): "
            f"{config.architecture} with this config.json has no such weight"
        )
    for tensor, shape in expected.items():
        entry = entries[tensor]
        if tensor in scales:
            if entry.dtype not in SCALE_DTYPES or entry.shape not in scales[tensor]:
                raise CheckpointError(
                    f"tensor {tensor} has dtype {entry.dtype} and shape {list(entry.shape)}: "
                    f"expected a float scale of shape one of {[list(s) for s in scales[tensor]]}"
                )
            continue
        if is_gguf(config.path):
            pass  # check_types has named any type that cannot be dequantized
        elif entry.dtype not in FLOAT_DTYPES and not _is_fp8_weight(config, entry, shape):
            raise CheckpointError(
                f"tensor {tensor} has dtype {entry.dtype}: expected one of {list(FLOAT_DTYPES)}, "
                f"or {FP8_DTYPE} matrices with an fp8 quantization_config (other quantized "
                "safetensors are not supported)"
            )
        if entry.shape != shape:
            raise CheckpointError(
                f"tensor {tensor} has shape {list(entry.shape)}, expected {list(shape)}"
            )


def _is_fp8_weight(config: HFConfig, entry: TensorEntry, shape: tuple[int, ...]) -> bool:
    return config.quantization is not None and entry.dtype == FP8_DTYPE and len(shape) == 2


def _scale_shapes(
    config: HFConfig, entries: dict[str, TensorEntry], expected: dict[str, tuple[int, ...]]
) -> dict[str, list[tuple[int, ...]]]:
    """The scale tensors each fp8 weight needs, with the shapes they may have: its weight scale,
    and under a static activation scheme its input scale (one per tensor)."""
    scheme = config.quantization
    if scheme is None:
        return {}
    fp8 = [
        t
        for t, shape in expected.items()
        if t in entries and _is_fp8_weight(config, entries[t], shape)
    ]
    scales = {scheme.scale_name(tensor): scheme.scale_shapes(expected[tensor]) for tensor in fp8}
    if scheme.activation_scheme == "static":
        scales |= {scheme.input_scale_name(tensor): [(), (1,)] for tensor in fp8}
    return scales


def check_tp_split(config: HFConfig, tp_size: int) -> None:
    """Heads, MLP and expert columns must split evenly; KV heads split, or replicate where TP
    exceeds them (then TP must be a multiple of them, so each rank's query heads share one KV
    head)."""
    if config.num_heads % tp_size:
        raise CheckpointError(
            f"num_attention_heads={config.num_heads} is not divisible by tp_size={tp_size}"
        )
    kv = config.num_kv_heads
    if (kv % tp_size) if tp_size <= kv else (tp_size % kv):
        raise CheckpointError(
            f"num_key_value_heads={kv} with tp_size={tp_size}: expected kv heads divisible by "
            "tp_size, or tp_size a multiple of kv heads"
        )
    has_dense_mlp = config.moe is None or not all(config.moe.sparse_layers)
    if has_dense_mlp and config.intermediate_size % tp_size:
        raise CheckpointError(
            f"intermediate_size={config.intermediate_size} is not divisible by tp_size={tp_size}"
        )
    # each expert's intermediate dimension splits across the ranks, as a dense MLP's does
    if config.moe is not None and config.moe.intermediate_size % tp_size:
        raise CheckpointError(
            f"{config.moe.intermediate_size_key}={config.moe.intermediate_size} is not "
            f"divisible by tp_size={tp_size}"
        )


def check_checkpoint(path: str, tp_size: int) -> HFConfig:
    """Refuse (CheckpointError) a folder this worker cannot serve at `tp_size`; its config.

    Reads config.json, generation_config.json and the safetensors headers, never the weights.
    """
    config = read_hf_config(path)
    check_tp_split(config, tp_size)
    if is_gguf(path):
        try:
            check_types(path, expected_shapes(config))
        except GGUFError as exc:
            raise CheckpointError(str(exc)) from None
    check_tensors(config, tensor_entries(Path(path)))
    return config
