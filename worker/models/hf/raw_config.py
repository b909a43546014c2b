"""config.json as read: the file's object, and its fields checked one at a time, each refusal a
CheckpointError naming the field, its value and what was expected. Shared by config.py and the
family readers (rope_config.py, gemma_config.py, phi3_config.py). Never imports torch.
"""

import json
import math
from pathlib import Path

LAYER_TYPES = ("full_attention", "sliding_attention")


class CheckpointError(ValueError):
    """A checkpoint this worker cannot serve; the message names the field or tensor."""


def read_json(path: Path) -> dict:
    try:
        with path.open() as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds {type(data).__name__}, expected a JSON object")
    return data


def positive_int(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def finite_number(
    raw: dict, key: str, default: float | None = None, where: str = "config.json"
) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise CheckpointError(f"{where} {key}={value!r}: expected a finite number")
    return float(value)


def optional_number(raw: dict, key: str, default: float | None) -> float | None:
    """raw[key] as a positive number, `default` when absent; an explicit null is None."""
    if key not in raw:
        return default
    if raw[key] is None:
        return None
    value = finite_number(raw, key)
    if value <= 0:
        raise CheckpointError(f"config.json {key}={value!r}: expected null or a positive number")
    return value


def read_window(raw: dict, default: int | None = None) -> int | None:
    window = raw.get("sliding_window", default)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise CheckpointError(f"config.json sliding_window={window!r}: expected null or >= 1")
    return window


def windows_of_layer_types(
    raw: dict, layer_types: object, window: int | None, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window: `window` for sliding_attention layers, None for full ones."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise CheckpointError(
            f"config.json layer_types={layer_types!r}: expected {num_layers} entries"
        )
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise CheckpointError(
            f"config.json layer_types has {unknown}: expected only {list(LAYER_TYPES)}"
        )
    if "sliding_attention" in layer_types and window is None:
        raise CheckpointError(
            "config.json layer_types names sliding_attention layers but the sliding window is "
            f"off (sliding_window={raw.get('sliding_window')!r}, use_sliding_window="
            f"{raw.get('use_sliding_window')!r}): expected both set"
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
