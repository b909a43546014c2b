"""Phi-3 (and Phi-3.5, Phi-4-mini): the fields of its config.json beyond the Llama family's
(fused tensors, partial rotary, longrope), read and refused here. Never imports torch.
"""

from worker.models.hf.raw_config import CheckpointError, positive_int, read_window
from worker.models.hf.rope_config import DEFAULT_ROPE_THETA, rope_from

PHI3_FAMILY = ("Phi3ForCausalLM",)


def phi3_fields(raw: dict, num_layers: int) -> dict:
    """Phi-3: fused qkv_proj and gate_up_proj tensors, partial rotary, longrope, and a window
    (when sliding_window is set) on every layer."""
    hidden_size, num_heads = (
        positive_int(raw, "hidden_size"),
        positive_int(raw, "num_attention_heads"),
    )
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    # transformers reads rope_scaling, else rope_parameters, never the two merged
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope = rope_from(params, raw, raw.get("rope_theta", DEFAULT_ROPE_THETA), partial_ok=True)
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
    return dict(rope=rope, sliding_windows=(read_window(raw),) * num_layers, fused_qkv_gate_up=True)
