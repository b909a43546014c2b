"""FP8 weights kept in fp8 (fp8_linear.py): which devices take the path, and, run on the CPU
(torch._scaled_mm runs there too), each rank's Fp8Linear equals its slice of the dequantized
weight applied to activations quantized as the checkpoint says: per token (dynamic) or by the
stored input scale (static), with per-channel and per-tensor weight scales, at TP 1 and 2.

Tolerances: against the same quantized activations times the dequantized weight the GEMM
differs only by its float32 summation order (rtol 1e-5); against unquantized float activations,
e4m3's 3 mantissa bits leave each product within 1/16 of its value, so the outputs' RMS error
stays under a tenth of their RMS.
"""

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.fp8_checkpoint import write_fp8_checkpoint as write_fp8_checkpoint_of
from tests.unit.hf_checkpoints import write_checkpoint
from tests.unit.test_hf_fp8 import write_fp8_checkpoint
from worker.models.hf.checkpoint import check_checkpoint, tensor_entries
from worker.models.hf.fp8_linear import (
    FP8_MAX,
    Fp8Linear,
    keeps_fp8_weights,
    quantize_activations,
)
from worker.models.hf.quantization import Fp8Scheme
from worker.models.hf.weights import RankShard, TensorReader

CPU = torch.device("cpu")
ATTN, MLP = "model.layers.0.self_attn.", "model.layers.0.mlp."
DYNAMIC = Fp8Scheme("fp8", "weight_scale", None, "dynamic")
STATIC_INPUT_AMAX = 5.0  # the calibrated range of the static case: randn inputs stay within it

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("device_type", "capability", "scheme", "keeps"),
    [
        ("cuda", (8, 9), DYNAMIC, True),  # Ada
        ("cuda", (9, 0), Fp8Scheme("compressed-tensors", "weight_scale", None, "static"), True),
        ("cuda", (10, 0), DYNAMIC, True),  # Blackwell
        ("cuda", (8, 6), DYNAMIC, False),  # Ampere: no FP8 tensor cores
        ("cuda", (8, 0), DYNAMIC, False),
        ("cpu", None, DYNAMIC, False),
        ("cuda", (9, 0), None, False),  # not an fp8 checkpoint
        ("cuda", (9, 0), Fp8Scheme("fp8", "weight_scale_inv", (128, 128), "dynamic"), False),
        ("cuda", (9, 0), Fp8Scheme("compressed-tensors", "weight_scale", None, None), False),
    ],
)
def test_the_path_is_chosen_by_device_capability_and_scheme(
    device_type: str, capability: tuple[int, int] | None, scheme: Fp8Scheme | None, keeps: bool
) -> None:
    assert keeps_fp8_weights(device_type, capability, scheme) is keeps


def test_activations_are_quantized_per_token_or_by_the_stored_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [900.0, 1.0, -3.0]])
    values, scale = quantize_activations(x, None)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert values.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]  # each row its own
    values, scale = quantize_activations(x, torch.tensor(1.0))
    assert scale.dim() == 0 and values.float()[2, 0] == 448.0  # past the range: saturated


@pytest.fixture(scope="module", params=["channel", "tensor", "tensor-static"])
def fp8_folder(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3 checkpoint's linear weights in fp8 (64 wide: every slice suits _scaled_mm); the
    static case keeps a per-tensor scheme with calibrated input scales."""
    scheme = request.param.removesuffix("-static")
    folder = tmp_path_factory.mktemp(f"fp8-linear-{request.param}")
    write_checkpoint(folder, "qwen3", seed=4, tie_word_embeddings=True)
    fp8 = write_fp8_checkpoint(folder, scheme)
    if request.param.endswith("-static"):
        tensors = load_file(fp8 / "model.safetensors")
        for name in [n for n in tensors if n.endswith("input_scale")]:
            tensors[name] = torch.tensor(STATIC_INPUT_AMAX / FP8_MAX)
        save_file(tensors, fp8 / "model.safetensors")
        config = json.loads((fp8 / "config.json").read_text())
        config["quantization_config"]["activation_scheme"] = "static"
        (fp8 / "config.json").write_text(json.dumps(config))
    return fp8


def _readers(folder: Path, stack: contextlib.ExitStack) -> tuple[TensorReader, TensorReader]:
    """(kept in fp8, dequantized) readers of the checkpoint in float32 on the CPU."""
    config = check_checkpoint(str(folder), 2)
    entries = tensor_entries(folder)
    keep = TensorReader(entries, stack, CPU, torch.float32, config.quantization, keeps_fp8=True)
    dense = TensorReader(entries, stack, CPU, torch.float32, config.quantization)
    return keep, dense


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_ranks_fp8_weights_equal_its_dequantized_slice(fp8_folder: Path, tp_size: int) -> None:
    """q/k/v and gate/up merged from parts (each part's scales on its rows), o and down cut by
    columns (every output channel's scale kept), for every rank."""
    config = check_checkpoint(str(fp8_folder), tp_size)
    is_static = config.quantization.activation_scheme == "static"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, config.hidden_size, generator=generator)
    x_heads = torch.randn(7, config.num_heads // tp_size * config.head_dim, generator=generator)
    x_inter = torch.randn(7, config.intermediate_size // tp_size, generator=generator)
    for rank in range(tp_size):
        shard = RankShard.of(config, rank, tp_size)
        hd = config.head_dim
        q, kv, mlp = shard.q_rows(hd), shard.kv_rows(hd), shard.mlp_rows()
        qkv = [(f"{ATTN}{n}.weight", r) for n, r in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        gate_up = [(f"{MLP}{n}.weight", mlp) for n in ("gate_proj", "up_proj")]
        with contextlib.ExitStack() as stack:
            keep, dense = _readers(fp8_folder, stack)
            cases = {
                "qkv": (keep.read_linear(qkv), dense.read_merged(qkv), x),
                "gate_up": (keep.read_linear(gate_up), dense.read_merged(gate_up), x),
                "o": (
                    keep.read_linear_cols(ATTN + "o_proj.weight", q),
                    dense.read(ATTN + "o_proj.weight", cols=q),
                    x_heads,
                ),
                "down": (
                    keep.read_linear_cols(MLP + "down_proj.weight", mlp),
                    dense.read(MLP + "down_proj.weight", cols=mlp),
                    x_inter,
                ),
            }
            assert keep.num_fp8_weights == len(cases)
        for name, (kept, reference, inputs) in cases.items():
            assert isinstance(kept, Fp8Linear) and kept.weight.dtype == torch.float8_e4m3fn
            assert (kept.input_scale is not None) == is_static, name
            got = kept(inputs)
            assert got.dtype == torch.float32 and got.shape == (7, reference.shape[0])
            values, scale = quantize_activations(inputs, kept.input_scale)
            same_inputs = (values.float() * scale) @ reference.T
            torch.testing.assert_close(got, same_inputs, rtol=1e-5, atol=1e-5)
            exact = inputs @ reference.T
            error = (got - exact).pow(2).mean().sqrt()
            assert error < 0.1 * exact.pow(2).mean().sqrt(), name


def test_fp8_weights_count_their_real_bytes(fp8_folder: Path) -> None:
    """One byte a weight, plus float32 scales: under a third of the float32 weight's bytes."""
    with contextlib.ExitStack() as stack:
        keep, dense = _readers(fp8_folder, stack)
        name = MLP + "up_proj.weight"
        kept = keep.read_linear([(name, slice(0, 128))])
        reference = dense.read(name)
    num_bytes = sum(t.numel() * t.element_size() for t in kept.tensors())
    scales = load_file(fp8_folder / "model.safetensors")[
        name.removesuffix("weight") + "weight_scale"
    ]
    assert num_bytes == reference.numel() + scales.numel() * 4 + (kept.input_scale is not None) * 4
    assert num_bytes < reference.numel() * reference.element_size() / 3


def test_a_bfloat16_compute_dtype_gets_bfloat16_outputs(fp8_folder: Path) -> None:
    with contextlib.ExitStack() as stack:
        config = check_checkpoint(str(fp8_folder), 1)
        reader = TensorReader(
            tensor_entries(fp8_folder), stack, CPU, torch.bfloat16, config.quantization, True
        )
        kept = reader.read_linear([(MLP + "up_proj.weight", slice(0, 128))])
    out = kept(torch.randn(3, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 128)


def test_the_benchs_fp8_copy_is_a_dynamic_per_channel_checkpoint(tmp_path: Path) -> None:
    """bench/fp8_checkpoint.py (what gpu_check serves in FP8): kvserve reads it as per-channel
    weights with per-token activations, the scheme that stays fp8 on FP8 GPUs, and its weights
    dequantize to within e4m3's rounding of the original."""
    write_checkpoint(tmp_path / "bf16", "qwen3", seed=5)
    fp8 = write_fp8_checkpoint_of(tmp_path / "bf16", tmp_path / "fp8")
    config = check_checkpoint(str(fp8), 2)
    assert config.quantization.activation_scheme == "dynamic"
    assert keeps_fp8_weights("cuda", (9, 0), config.quantization)
    name = MLP + "gate_proj.weight"
    original = load_file(tmp_path / "bf16" / "model.safetensors")[name]
    with contextlib.ExitStack() as stack:
        _, dense = _readers(fp8, stack)
        restored = dense.read(name)
    assert load_file(fp8 / "model.safetensors")[name].dtype == torch.float8_e4m3fn
    assert ((restored - original).abs() <= original.abs().amax(1, keepdim=True) / 16).all()
