"""GenerationDefaults: the sampling defaults of `--generation-config` (vLLM's flag), applied to a
request's fields that the request leaves unset.

`auto` reads the checkpoint's generation_config.json, `vllm` reads nothing (kvserve's and OpenAI's
own defaults), and a folder reads that folder's generation_config.json. Only the sampling fields
vLLM takes from the file are read: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens.
"""

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder
# generation_config.json's names -> GenerationDefaults' (the request's) names
FILE_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults for a request's unset sampling fields; None: kvserve's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens

    def applied(self) -> dict[str, float | int]:
        """The defaults this sets, by request field name."""
        return {name: value for name, value in asdict(self).items() if value is not None}


NO_DEFAULTS = GenerationDefaults()


def load_generation_defaults(mode: str, model: str) -> GenerationDefaults:
    """The defaults `--generation-config mode` gives for `--model model` (a folder, or a built-in
    model name that has no file); ValueError naming the file or the mode otherwise."""
    if mode == "vllm":
        return NO_DEFAULTS
    folder = Path(model) if mode == "auto" else Path(mode)
    if mode != "auto" and not folder.is_dir():
        raise ValueError(
            f"--generation-config {mode}: expected 'auto', 'vllm' or a folder holding "
            f"{GENERATION_CONFIG_FILE}"
        )
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: no {GENERATION_CONFIG_FILE} there")
        return NO_DEFAULTS  # a built-in model, or a checkpoint without one
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return GenerationDefaults(
        **{
            FILE_FIELDS[key]: _checked(path, key, raw[key])
            for key in FILE_FIELDS
            if raw.get(key) is not None
        }
    )


def _checked(path: Path, key: str, value: object) -> float | int:
    is_int = key in ("top_k", "max_new_tokens")
    kinds = (int,) if is_int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        kind = "an integer" if is_int else "a number"
        raise ValueError(f"{path}: {key}={value!r}: expected {kind}")
    return value


def log_generation_defaults(defaults: GenerationDefaults, mode: str) -> None:
    """One line at start-up, as vLLM logs the defaults it took from the model."""
    applied = defaults.applied()
    if applied:
        logger.info(
            "default sampling parameters from --generation-config %s: %s (a request's own "
            "values win; --generation-config vllm ignores the file)",
            mode,
            applied,
        )
