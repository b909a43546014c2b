"""FP8 checkpoints: linear weights stored as float8 e4m3 with their scales (per channel, per
tensor, per 2-D block, as compressed-tensors and the fp8 method write them) serve greedy tokens
equal to transformers running the same weights dequantized, in float32, at TP 1 and 2 (ranks as
threads, each dequantizing its own slices), with prefix caching, chunked prefill and preemption.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.workload import run_workload
from tests.unit.hf_checkpoints import ARCHS, hf_greedy, write_checkpoint
from tests.unit.test_hf_generate import PROMPTS, assert_greedy_matches, workload
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import CheckpointError
from worker.models.hf.quantization import dequantize

CPU = torch.device("cpu")
MAX_TOKENS = 10
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = {
    "channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
    "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "block": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 16]},
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def quantize(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as float8 and its scale, the way `scheme` stores them."""
    if scheme == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
    elif scheme == "tensor":
        scale = weight.abs().amax().reshape(()) / FP8_MAX
    else:
        rows, cols = SCHEMES["block"]["weight_block_size"]
        out, inp = weight.shape
        blocks = weight.reshape(out // rows, rows, inp // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        expanded = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return (weight / expanded).to(torch.float8_e4m3fn), scale
    return (weight / scale).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(folder: Path, scheme: str) -> Path:
    """`folder`'s float32 checkpoint re-written with fp8 linear weights into `folder`/fp8; the
    float32 one is overwritten with those weights dequantized, for transformers."""
    tensors = load_file(folder / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEAR)):
            values, scale = quantize(tensor, scheme)
            scale_name = name.removesuffix("weight") + (
                "weight_scale_inv" if scheme == "block" else "weight_scale"
            )
            quantized[name], quantized[scale_name] = values, scale
            if scheme != "block":  # a static activation scale, which is read past
                quantized[name.removesuffix("weight") + "input_scale"] = torch.ones(())
            whole = (slice(0, tensor.shape[0]), slice(0, tensor.shape[1]))
            block = tuple(SCHEMES["block"]["weight_block_size"]) if scheme == "block" else None
            dequantized[name] = dequantize(values, scale, block, *whole)
        else:
            quantized[name] = dequantized[name] = tensor
    fp8 = folder / "fp8"
    fp8.mkdir()
    save_file(quantized, fp8 / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = SCHEMES[scheme]
    (fp8 / "config.json").write_text(json.dumps(config))
    save_file(dequantized, folder / "model.safetensors", metadata={"format": "pt"})
    return fp8


@pytest.fixture(scope="module", params=list(SCHEMES))
def fp8_case(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """An fp8 checkpoint and transformers' greedy references on its dequantized weights."""
    folder = tmp_path_factory.mktemp(f"fp8-{request.param}")
    write_checkpoint(folder, "qwen3", seed=3, tie_word_embeddings=True)
    fp8 = write_fp8_checkpoint(folder, request.param)
    model = ARCHS["qwen3"][1].from_pretrained(folder, dtype=torch.float32).eval()
    return fp8, [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]


def test_fp8_weights_are_one_byte_each(fp8_case: tuple[Path, list]) -> None:
    folder, _ = fp8_case
    tensors = load_file(folder / "model.safetensors")
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert check_checkpoint(str(folder), 2).quantization is not None


def test_fp8_greedy_tokens_equal_transformers_dequantized(fp8_case: tuple[Path, list]) -> None:
    folder, references = fp8_case
    work = workload(folder, max_num_batched_tokens=12, async_scheduling=True)
    result = run_workload(work, single_rank_group(), CPU)
    assert result.num_hit_tokens > 0
    assert_greedy_matches(folder.parent.name, result, references)


def test_fp8_tp2_with_preemption(fp8_case: tuple[Path, list]) -> None:
    """Each rank dequantizes only its rows (q/k/v, gate/up) or columns (o, down)."""
    folder, references = fp8_case
    work = workload(folder, 24, max_num_batched_tokens=16, async_scheduling=True)
    rank0, rank1 = run_ranks(2, lambda group: run_workload(work, group, CPU))
    assert rank0.outputs == rank1.outputs
    assert rank0.num_preemptions > 0
    assert_greedy_matches(folder.parent.name, rank0, references)


def test_refusals_name_the_field(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    cases = {
        "awq": ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        "int8": (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            "type='int'",
        ),
        "block": ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    }
    for quantization, expected in cases.values():
        config_file.write_text(json.dumps(config | {"quantization_config": quantization}))
        with pytest.raises(CheckpointError, match=expected):
            check_checkpoint(str(tmp_path), 1)
    # fp8 tensors without a quantization_config, and an fp8 weight without its scale
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors")
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has dtype F8_E4M3"):
        check_checkpoint(str(tmp_path), 1)
    config_file.write_text(json.dumps(config | {"quantization_config": SCHEMES["tensor"]}))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_scale is missing"):
        check_checkpoint(str(tmp_path), 1)
