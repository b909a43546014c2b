"""MoeConfig: the mixture-of-experts fields of a Qwen3-MoE or Mixtral config.json, read and
refused here (a CheckpointError naming the field), and the tensor names and shapes they imply.

Qwen3-MoE replaces the MLP of each sparse layer (those not in `mlp_only_layers`, every
`decoder_sparse_step`-th) by `num_experts` SiLU-gated experts of `moe_intermediate_size`, picked
`num_experts_per_tok` at a time and renormalised only with `norm_topk_prob`; its dense layers keep
an MLP of `intermediate_size`. Mixtral's every layer is sparse: `num_local_experts` experts of
`intermediate_size`, the top-k always renormalised. Never imports torch (config.py's rule).
"""

import json
from dataclasses import dataclass
from pathlib import Path

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """One checkpoint's experts (whole model, before TP)."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    intermediate_size: int  # of each expert
    intermediate_size_key: str  # the config.json field it came from, for refusals
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    # Mixtral multiplies an expert's output by its float32 routing weight, then rounds to the
    # compute dtype; Qwen3-MoE rounds the weight to the compute dtype first (equal in float32)
    is_weighted_in_float32: bool
    sparse_layers: tuple[bool, ...]  # per layer: its MLP is the experts
    prefix: str  # the layer's MoE block: "mlp." (Qwen3-MoE) or "block_sparse_moe."
    # each expert's gate, up and down tensor names: gate_proj/up_proj/down_proj or w1/w3/w2
    gate_name: str
    up_name: str
    down_name: str

    def expert_tensor(self, layer_idx: int, expert_idx: int, name: str) -> str:
        return f"model.layers.{layer_idx}.{self.prefix}experts.{expert_idx}.{name}.weight"

    def router_tensor(self, layer_idx: int) -> str:
        return f"model.layers.{layer_idx}.{self.prefix}gate.weight"


class MoeConfigError(ValueError):
    """A refused MoE field; read_hf_config re-raises it as its CheckpointError, same message
    (this module cannot import config.py, which imports it)."""


def _positive(key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MoeConfigError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def read_moe_config(raw: dict, architecture: str, num_layers: int) -> MoeConfig | None:
    """The experts config.json describes, None for a dense architecture; MoeConfigError names a
    field that is missing or out of range."""
    if architecture == "Qwen3MoeForCausalLM":
        return _qwen3_moe(raw, num_layers)
    if architecture == "MixtralForCausalLM":
        return _mixtral(raw, num_layers)
    return None


def _top_k(raw: dict, num_experts: int, experts_key: str) -> int:
    top_k = _positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise MoeConfigError(
            f"config.json num_experts_per_tok={top_k}: expected at most {experts_key}={num_experts}"
        )
    return top_k


def _qwen3_moe(raw: dict, num_layers: int) -> MoeConfig:
    # the hub spells it num_experts; transformers 5 saves num_local_experts
    experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    num_experts = _positive(experts_key, raw.get(experts_key))
    step = _positive("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise MoeConfigError(f"config.json mlp_only_layers={dense!r}: expected a list of layers")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise MoeConfigError(f"config.json norm_topk_prob={norm!r}: expected true or false")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=_top_k(raw, num_experts, experts_key),
        intermediate_size=_positive("moe_intermediate_size", raw.get("moe_intermediate_size")),
        intermediate_size_key="moe_intermediate_size",
        norm_topk_prob=norm,
        is_weighted_in_float32=False,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        prefix="mlp.",
        gate_name="gate_proj",
        up_name="up_proj",
        down_name="down_proj",
    )


def _mixtral(raw: dict, num_layers: int) -> MoeConfig:
    num_experts = _positive("num_local_experts", raw.get("num_local_experts"))
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=_top_k(raw, num_experts, "num_local_experts"),
        intermediate_size=_positive("intermediate_size", raw.get("intermediate_size")),
        intermediate_size_key="intermediate_size",
        norm_topk_prob=True,
        is_weighted_in_float32=True,
        sparse_layers=(True,) * num_layers,
        prefix="block_sparse_moe.",
        gate_name="w1",
        up_name="w3",
        down_name="w2",
    )


def is_moe_checkpoint(model: str) -> bool:
    """Whether `--model` is a checkpoint folder whose config.json names a MoE architecture (a
    folder it cannot read is not: read_hf_config refuses that one, naming why)."""
    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    return isinstance(architectures, list) and any(a in MOE_ARCHITECTURES for a in architectures)


def moe_shapes(moe: MoeConfig, layer_idx: int, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one sparse layer's MoE block, with their whole-model shapes."""
    inter = moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        moe.router_tensor(layer_idx): (moe.num_experts, hidden_size)
    }
    for expert in range(moe.num_experts):
        shapes |= {
            moe.expert_tensor(layer_idx, expert, moe.gate_name): (inter, hidden_size),
            moe.expert_tensor(layer_idx, expert, moe.up_name): (inter, hidden_size),
            moe.expert_tensor(layer_idx, expert, moe.down_name): (hidden_size, inter),
        }
    return shapes
