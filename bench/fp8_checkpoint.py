"""An FP8 copy of a checkpoint, as llm-compressor's FP8_DYNAMIC scheme writes one: every decoder
linear weight in float8 e4m3 with a float32 scale per output channel, activations quantized per
token as the model runs (compressed-tensors, `dynamic: true`); embeddings, norms and lm_head stay
as they were. bench/gpu_checkpoint_checks.py serves it beside the bfloat16 original.

Run: `python -m bench.fp8_checkpoint SRC DST`.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
LINEAR_SUFFIXES = tuple(
    f"{name}.weight"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as float8 and its float32 scale [out, 1]: each row by its absolute
    maximum, so that row's largest value maps to e4m3's largest."""
    values = weight.to(torch.float32)
    scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(source: Path, target: Path) -> Path:
    """`source`'s safetensors checkpoint quantized into `target` (the other files copied)."""
    target.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for path in sorted(source.iterdir()):
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            out = {}
            for name, tensor in tensors.items():
                if name.endswith(LINEAR_SUFFIXES):
                    values, scale = quantize_per_channel(tensor.to(device))
                    out[name] = values.cpu()
                    out[name.removesuffix("weight") + "weight_scale"] = scale.cpu()
                else:
                    out[name] = tensor
            save_file(out, target / path.name, metadata={"format": "pt"})
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["quantization_config"] = QUANTIZATION_CONFIG
            (target / path.name).write_text(json.dumps(config, indent=2))
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            weight_map = index["weight_map"]
            for name, file in list(weight_map.items()):
                if name.endswith(LINEAR_SUFFIXES):
                    weight_map[name.removesuffix("weight") + "weight_scale"] = file
            (target / path.name).write_text(json.dumps(index, indent=2))
        elif path.is_file():
            shutil.copy(path, target / path.name)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_checkpoint", description=__doc__)
    parser.add_argument("source", type=Path, help="a checkpoint folder (safetensors)")
    parser.add_argument("target", type=Path, help="the folder the fp8 copy goes to")
    args = parser.parse_args(argv)
    write_fp8_checkpoint(args.source, args.target)
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
