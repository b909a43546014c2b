"""RopeConfig: a checkpoint's rotary parameters, read from either spelling (the hub's top-level
`rope_theta`/`rope_scaling`, transformers 5's `rope_parameters`) and checked. rope.py computes
with them. Never imports torch.
"""

from dataclasses import dataclass

from worker.models.hf.raw_config import CheckpointError, finite_number

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ROPE_TYPES_WITH_ORIGINAL_LEN = ("llama3", "yarn", "longrope")  # default: max_position_embeddings
DEFAULT_ROPE_THETA = 10000.0  # every supported architecture's default


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


def read_rope(raw: dict) -> RopeConfig:
    """Merge rope_parameters (transformers 5) with rope_scaling (the hub's older spelling)."""
    params = dict(raw.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise CheckpointError(
            f"config.json rope_parameters has per-layer-type entries {sorted(params)}: expected "
            "one set of rotary parameters for every layer"
        )
    return rope_from(with_scaling(params, raw), raw, raw.get("rope_theta", DEFAULT_ROPE_THETA))


def with_scaling(params: dict, raw: dict) -> dict:
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


def rope_from(
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
    partial = finite_number({"partial_rotary_factor": partial}, "partial_rotary_factor")
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(
            f"config.json partial_rotary_factor={partial!r}: expected a share in (0, 1]"
        )
    theta = finite_number(params, "rope_theta", default_theta, "rope")
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
            optional[key] = finite_number(params, key, where=where)
    factors: dict = {}
    if rope_type == "longrope":
        # factor defaults to how far max_position_embeddings stretches the pretraining context
        factor = finite_number(params, "factor", raw["max_position_embeddings"] / original, where)
        factors = {key: _factor_list(params, key) for key in ("short_factor", "long_factor")}
    else:
        factor = finite_number(params, "factor", where=where)
    return RopeConfig(
        rope_type,
        theta,
        factor=factor,
        low_freq_factor=finite_number(params, "low_freq_factor", 1.0, where),
        high_freq_factor=finite_number(params, "high_freq_factor", 4.0, where),
        original_max_position_embeddings=int(original or 0),
        beta_fast=finite_number(params, "beta_fast", 32.0, where),
        beta_slow=finite_number(params, "beta_slow", 1.0, where),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
        **optional,
        **factors,
    )


def _factor_list(params: dict, key: str) -> tuple[float, ...]:
    values = params.get(key)
    if not isinstance(values, list) or not values:
        raise CheckpointError(f"config.json rope longrope {key}={values!r}: expected a list")
    return tuple(finite_number({key: v}, key, where="rope longrope") for v in values)
