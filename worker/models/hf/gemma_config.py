"""Gemma 2 and Gemma 3 (text): the fields of their config.json beyond the Llama family's
(GeGLU, `(1 + weight)` norms, `query_pre_attn_scalar`, soft-caps, sliding layers by
`layer_types`, and Gemma 3's rope per layer type), read and refused here. Never imports torch.
"""

from worker.models.hf.raw_config import (
    LAYER_TYPES,
    CheckpointError,
    finite_number,
    optional_number,
    positive_int,
    read_window,
    windows_of_layer_types,
)
from worker.models.hf.rope_config import RopeConfig, read_rope, rope_from, with_scaling

GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with the tanh approximation of GELU
# Gemma 3's thetas when config.json names none: the global layers', then the sliding layers'
GEMMA3_DEFAULT_THETA, GEMMA3_DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0
GEMMA3_DEFAULT_SLIDING_PATTERN = 6  # every 6th layer global, when neither layer_types is given


def gemma_fields(raw: dict, architecture: str, num_layers: int) -> dict:
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
        pattern = positive_int({"sliding_window_pattern": pattern}, "sliding_window_pattern", 6)
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    scalar = finite_number(raw, "query_pre_attn_scalar", 256)
    if scalar <= 0:
        raise CheckpointError(f"config.json query_pre_attn_scalar={scalar!r}: expected > 0")
    if is_gemma2:
        rope, sliding_rope = read_rope(raw), None
    else:
        rope, sliding_rope = _gemma3_ropes(raw)
    return dict(
        rope=rope,
        sliding_windows=windows_of_layer_types(
            raw, layer_types, read_window(raw, 4096), num_layers
        ),
        hidden_act=GEMMA_ACTIVATION,
        gemma_norms=True,
        attention_scale=scalar**-0.5,
        # Gemma 3's attention reads no attn_logit_softcapping (transformers ignores the field)
        attn_softcap=optional_number(raw, "attn_logit_softcapping", 50.0) if is_gemma2 else None,
        final_softcap=optional_number(raw, "final_logit_softcapping", 30.0 if is_gemma2 else None),
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
    full = with_scaling(dict(params.get("full_attention") or {}), raw)
    sliding = dict(params.get("sliding_attention") or {})
    full_theta = raw.get("rope_theta", GEMMA3_DEFAULT_THETA)
    sliding_theta = raw.get("rope_local_base_freq", GEMMA3_DEFAULT_LOCAL_THETA)
    return rope_from(full, raw, full_theta), rope_from(sliding, raw, sliding_theta)
