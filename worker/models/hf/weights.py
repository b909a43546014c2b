"""One rank's weights of a checkpoint, read slice by slice from memory-mapped safetensors files.

A rank reads only its shard of every sharded tensor (its query heads, its KV heads, its MLP
columns, its columns of every expert), so no rank ever holds the whole model; embeddings, norms,
routers and lm_head are replicated. Each weight is cast once to the compute dtype and moved to
the rank's device; on the CPU a whole tensor already in that dtype stays a view of the mapped
file (the embedding and norms page in on first use, shared by the host's ranks). q/k/v and gate/up
(each expert's too) are merged into new tensors of this rank's rows (from separate tensors, or
from Phi-3's fused qkv_proj and gate_up_proj), and on the CPU every matrix but the routers is
packed for the GEMM (linear.py). An fp8 checkpoint's linear weights are dequantized as they are
read, or, on CUDA devices with FP8, kept in fp8 with their scales (fp8_linear.py), sliced alike.
"""

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker.models.hf.checkpoint import TensorEntry, tensor_entries
from worker.models.hf.config import HFConfig
from worker.models.hf.fp8_linear import (
    Fp8Linear,
    can_keep,
    keeps_fp8_weights,
    merged_weight_scale,
    weight_tensors,
)
from worker.models.hf.gguf_file import is_gguf, read_tensor
from worker.models.hf.linear import pack
from worker.models.hf.moe import MoeWeights
from worker.models.hf.quantization import FP8_DTYPE, Fp8Scheme, dequantize

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankShard:
    """Which heads and MLP columns rank `rank` of `tp_size` owns.

    KV heads split evenly; where tp_size exceeds them, each rank holds the one KV head its query
    heads read (as vLLM replicates them), so num_kv_heads_per_rank is 1.
    """

    rank: int
    tp_size: int
    num_heads_per_rank: int
    num_kv_heads_per_rank: int
    first_kv_head: int
    num_intermediate_per_rank: int
    num_expert_intermediate_per_rank: int = 0  # of each expert; 0 without experts

    @classmethod
    def of(cls, config: HFConfig, rank: int, tp_size: int) -> "RankShard":
        num_kv = config.num_kv_heads
        num_kv_per_rank = max(1, num_kv // tp_size)
        first_kv = rank * num_kv // tp_size if tp_size > num_kv else rank * num_kv_per_rank
        return cls(
            rank,
            tp_size,
            config.num_heads // tp_size,
            num_kv_per_rank,
            first_kv,
            config.intermediate_size // tp_size,
            0 if config.moe is None else config.moe.intermediate_size // tp_size,
        )

    def q_rows(self, head_dim: int) -> slice:
        size = self.num_heads_per_rank * head_dim
        return slice(self.rank * size, (self.rank + 1) * size)

    def kv_rows(self, head_dim: int) -> slice:
        start = self.first_kv_head * head_dim
        return slice(start, start + self.num_kv_heads_per_rank * head_dim)

    def mlp_rows(self) -> slice:
        size = self.num_intermediate_per_rank
        return slice(self.rank * size, (self.rank + 1) * size)

    def expert_rows(self) -> slice:
        size = self.num_expert_intermediate_per_rank
        return slice(self.rank * size, (self.rank + 1) * size)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer on one rank; linear weights are [out, in] as the checkpoint stores them.

    q/k/v and gate/up are merged at load, this rank's rows of each side by side, so that a layer
    runs one GEMM for each pair instead of five (small GEMMs cost more per byte, on any device).
    """

    input_norm: torch.Tensor  # [D]
    # The four linear weights may be Fp8Linear (kept in fp8 with their scales, CUDA)
    qkv_proj: torch.Tensor | Fp8Linear  # [(H_r + 2 * KV_r) * head_dim, D]: q, then k, then v rows
    o_proj: torch.Tensor | Fp8Linear  # [D, H_r * head_dim]: this rank's input columns
    post_attention_norm: torch.Tensor  # [D]
    gate_up_proj: torch.Tensor | Fp8Linear | None  # [2 * I_r, D]: gate rows, then up rows
    down_proj: torch.Tensor | Fp8Linear | None  # [D, I_r]; both None where experts replace it
    qkv_bias: torch.Tensor | None = None  # [(H_r + 2 * KV_r) * head_dim], as qkv_proj's rows
    o_bias: torch.Tensor | None = None  # [D]: added once, after the all-reduce
    gate_up_bias: torch.Tensor | None = None  # [2 * I_r], as gate_up_proj's rows
    down_bias: torch.Tensor | None = None  # [D]: added once, after the all-reduce
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim] (Qwen3, Gemma 3)
    moe: MoeWeights | None = None  # a sparse layer's router and experts (Qwen3-MoE, Mixtral)
    pre_feedforward_norm: torch.Tensor | None = None  # [D] (Gemma: before the MLP)
    post_feedforward_norm: torch.Tensor | None = None  # [D] (Gemma: after the MLP)

    def tensors(self) -> list[torch.Tensor]:
        present = (getattr(self, name) for name in LayerWeights.__slots__)
        weights = [t for t in present if isinstance(t, torch.Tensor | Fp8Linear)]
        tensors = [t for weight in weights for t in weight_tensors(weight)]
        return tensors if self.moe is None else tensors + self.moe.tensors()


@dataclass(slots=True)
class DecoderWeights:
    embed_tokens: torch.Tensor  # [V, D], replicated
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D], replicated; the embedding itself when tied

    def num_bytes(self) -> int:
        tensors = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors.extend(layer.tensors())
        return sum(t.numel() * t.element_size() for t in tensors)


class TensorReader:
    """Reads tensors or row ranges of them from the checkpoint's memory-mapped files."""

    def __init__(
        self,
        entries: dict[str, TensorEntry],
        stack: contextlib.ExitStack,
        device: torch.device,
        dtype: torch.dtype,
        quantization: Fp8Scheme | None = None,
        keeps_fp8: bool = False,  # fp8 linear weights stay fp8 (keeps_fp8_weights)
    ) -> None:
        self.entries = entries
        self.quantization = quantization
        self.keeps_fp8 = keeps_fp8 and quantization is not None
        self.num_fp8_weights = 0  # linear weights kept in fp8 so far
        self.stack = stack
        self.device = device
        self.dtype = dtype
        self.files: dict[Path, object] = {}

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        view = self._view(name)
        if cols is not None:
            part = view[:, cols]
        elif rows is not None:
            part = view[rows]
        else:
            part = view[:]
        if self.entries[name].dtype == FP8_DTYPE and self.quantization is not None:
            # dequantized here, on the host, one rank's slice at a time
            shape = self.entries[name].shape
            part = dequantize(
                part,
                self._tensor(self.quantization.scale_name(name)),
                self.quantization.block,
                _whole(rows, shape[0]),
                _whole(cols, shape[1]),
            )
        return part.to(device=self.device, dtype=self.dtype).contiguous()

    def _view(self, name: str):
        return self._file(name).get_slice(name)

    def _tensor(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def read_linear(self, parts: list[tuple[str, slice]]) -> torch.Tensor | Fp8Linear:
        """A column-parallel weight: the row ranges `parts` of one or more tensors, merged;
        kept in fp8 where this rank keeps fp8 weights, else in the compute dtype and packed."""
        kept = self._fp8_linear(parts, None)
        return kept if kept is not None else pack(self.read_merged(parts))

    def read_linear_cols(self, name: str, cols: slice) -> torch.Tensor | Fp8Linear:
        """A row-parallel weight: this rank's input columns `cols` of `name`."""
        kept = self._fp8_linear([(name, None)], cols)
        return kept if kept is not None else pack(self.read(name, cols=cols))

    def _fp8_linear(
        self, parts: list[tuple[str, slice | None]], cols: slice | None
    ) -> Fp8Linear | None:
        """The parts' fp8 bytes and scales as one Fp8Linear; None where they are dequantized
        instead (not kept here, a part in float, or a slice torch._scaled_mm cannot take)."""
        scheme = self.quantization
        if not self.keeps_fp8 or scheme is None:
            return None
        if any(self.entries[name].dtype != FP8_DTYPE for name, _ in parts):
            return None
        shapes = [self.entries[name].shape for name, _ in parts]
        rows = [_whole(part, shape[0]) for (_, part), shape in zip(parts, shapes, strict=True)]
        num_cols = shapes[0][1] if cols is None else cols.stop - cols.start
        if not can_keep(sum(r.stop - r.start for r in rows), num_cols):
            return None
        pieces = [
            self._view(name)[part] if cols is None else self._view(name)[:, cols]
            for (name, _), part in zip(parts, rows, strict=True)
        ]
        scales = [self._tensor(scheme.scale_name(name)) for name, _ in parts]
        # a rank's columns of a weight keep every output channel, so every channel's scale
        weight_scale = merged_weight_scale(scales, rows, [shape[0] for shape in shapes])
        input_scale = None
        if scheme.activation_scheme == "static":  # the largest: no part's input saturates
            stored = [self._tensor(scheme.input_scale_name(name)) for name, _ in parts]
            input_scale = torch.stack([s.to(torch.float32).reshape(()) for s in stored]).max()
            input_scale = input_scale.to(self.device)
        self.num_fp8_weights += 1
        return Fp8Linear(
            torch.cat(pieces).to(self.device).contiguous(),
            weight_scale.to(self.device),
            input_scale,
            self.dtype,
        )

    def _file(self, name: str):
        file = self.entries[name].file
        if file not in self.files:
            self.files[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return self.files[file]

    def read_if(
        self, is_present: bool, name: str, rows: slice | None = None
    ) -> torch.Tensor | None:
        return self.read(name, rows) if is_present else None

    def read_merged(self, parts: list[tuple[str, slice]]) -> torch.Tensor:
        """The row ranges `parts` of several tensors, stacked in that order (one new tensor)."""
        return torch.cat([self.read(name, rows) for name, rows in parts])

    def read_merged_if(
        self, is_present: bool, parts: list[tuple[str, slice]]
    ) -> torch.Tensor | None:
        return self.read_merged(parts) if is_present else None


class GGUFTensorReader(TensorReader):
    """Reads a GGUF file's tensors by their Hugging Face names, dequantizing this rank's slices
    (gguf_file.py); a llama's q and k rows come back in Hugging Face's order."""

    def __init__(self, config: HFConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__({}, contextlib.ExitStack(), device, dtype)
        self.path = config.path
        # llama.cpp permutes a llama's q and k rows within each head (q: query heads, k: KV heads)
        self.permuted_heads = (
            {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
            if config.architecture == "LlamaForCausalLM"
            else {}
        )

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else None
        values = read_tensor(self.path, name, rows, cols, self.permuted_heads.get(module))
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype).contiguous()


def _whole(part: slice | None, size: int) -> slice:
    return slice(0, size) if part is None else slice(part.start or 0, part.stop)


def load_rank_weights(
    config: HFConfig, shard: RankShard, device: torch.device, dtype: torch.dtype
) -> DecoderWeights:
    """This rank's weights; the checkpoint must have passed check_checkpoint."""
    with contextlib.ExitStack() as stack:
        if is_gguf(config.path):
            reader = GGUFTensorReader(config, device, dtype)
        else:
            entries = tensor_entries(Path(config.path))
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            keeps = keeps_fp8_weights(device.type, capability, config.quantization)
            reader = TensorReader(entries, stack, device, dtype, config.quantization, keeps)
        layers = [_layer(config, shard, reader, i) for i in range(config.num_layers)]
        if config.quantization is not None:
            logger.info(
                "fp8 weights on %s: %s",
                device,
                f"{reader.num_fp8_weights} linear weights kept in float8 (torch._scaled_mm)"
                if reader.num_fp8_weights
                else f"dequantized to {dtype} at load",
            )
        embed = reader.read("model.embed_tokens.weight")
        # tied, the packed head is a second copy of the embedding where packing applies
        lm_head = pack(embed if config.tie_word_embeddings else reader.read("lm_head.weight"))
        return DecoderWeights(embed, layers, reader.read("model.norm.weight"), lm_head)


def _shifted(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _fused_parts(
    config: HFConfig, shard: RankShard
) -> tuple[list[tuple[str, slice]], list[tuple[str, slice]]]:
    """This rank's (tensor, rows) of q, k, v and of gate, up: in one qkv_proj tensor (q rows,
    then k rows, then v rows) and one gate_up_proj (gate rows, then up rows) for Phi-3; in a
    tensor each elsewhere."""
    hd = config.head_dim
    q_rows, kv_rows, mlp_rows = shard.q_rows(hd), shard.kv_rows(hd), shard.mlp_rows()
    if not config.fused_qkv_gate_up:
        qkv = [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)]
        return qkv, [("gate_proj", mlp_rows), ("up_proj", mlp_rows)]
    q_size, kv_size = config.num_heads * hd, config.num_kv_heads * hd
    qkv = [
        ("qkv_proj", q_rows),
        ("qkv_proj", _shifted(kv_rows, q_size)),
        ("qkv_proj", _shifted(kv_rows, q_size + kv_size)),
    ]
    up_rows = _shifted(mlp_rows, config.intermediate_size)
    return qkv, [("gate_up_proj", mlp_rows), ("gate_up_proj", up_rows)]


def _layer(config: HFConfig, shard: RankShard, reader: TensorReader, idx: int) -> LayerWeights:
    hd = config.head_dim
    q_rows, mlp_rows = shard.q_rows(hd), shard.mlp_rows()
    prefix = f"model.layers.{idx}."
    attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    has_qkv_bias, has_mlp_bias = config.has_qkv_bias, config.has_mlp_bias
    qkv, gate_up = _fused_parts(config, shard)
    is_sparse = config.moe is not None and config.moe.sparse_layers[idx]
    return LayerWeights(
        input_norm=reader.read(f"model.layers.{idx}.input_layernorm.weight"),
        qkv_proj=reader.read_linear([(f"{attn}{name}.weight", rows) for name, rows in qkv]),
        o_proj=reader.read_linear_cols(attn + "o_proj.weight", q_rows),
        post_attention_norm=reader.read(f"model.layers.{idx}.post_attention_layernorm.weight"),
        gate_up_proj=None
        if is_sparse
        else reader.read_linear([(f"{mlp}{name}.weight", rows) for name, rows in gate_up]),
        down_proj=None
        if is_sparse
        else reader.read_linear_cols(mlp + "down_proj.weight", mlp_rows),
        qkv_bias=reader.read_merged_if(
            has_qkv_bias, [(f"{attn}{name}.bias", rows) for name, rows in qkv]
        ),
        o_bias=reader.read_if(config.has_o_bias, attn + "o_proj.bias"),
        gate_up_bias=reader.read_merged_if(
            has_mlp_bias, [(f"{mlp}{name}.bias", rows) for name, rows in gate_up]
        ),
        down_bias=reader.read_if(has_mlp_bias, mlp + "down_proj.bias"),
        q_norm=reader.read_if(config.has_qk_norm, attn + "q_norm.weight"),
        k_norm=reader.read_if(config.has_qk_norm, attn + "k_norm.weight"),
        moe=_moe(config, shard, reader, idx) if is_sparse else None,
        pre_feedforward_norm=reader.read_if(
            config.gemma_norms, prefix + "pre_feedforward_layernorm.weight"
        ),
        post_feedforward_norm=reader.read_if(
            config.gemma_norms, prefix + "post_feedforward_layernorm.weight"
        ),
    )


def _moe(config: HFConfig, shard: RankShard, reader: TensorReader, idx: int) -> MoeWeights:
    """The router (whole) and this rank's rows of every expert: gate and up merged, as a dense
    MLP's are, and down's matching input columns."""
    moe, rows = config.moe, shard.expert_rows()
    assert moe is not None
    gate_up, down = [], []
    for expert in range(moe.num_experts):
        gate, up = (moe.expert_tensor(idx, expert, name) for name in (moe.gate_name, moe.up_name))
        gate_up.append(reader.read_linear([(gate, rows), (up, rows)]))
        down.append(reader.read_linear_cols(moe.expert_tensor(idx, expert, moe.down_name), rows))
    return MoeWeights(
        router=reader.read(moe.router_tensor(idx)),
        gate_up_proj=gate_up,
        down_proj=down,
        num_experts_per_tok=moe.num_experts_per_tok,
        norm_topk_prob=moe.norm_topk_prob,
        is_weighted_in_float32=moe.is_weighted_in_float32,
    )
