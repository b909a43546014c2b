"""The decoder's fused Triton kernels (worker/models/hf/fused_kernels.py) compute what
TorchLayerOps (the CPU path) computes: within 1e-6 in float32 (only the order of a row's float32
sum differs) and to the bfloat16 rounding in bfloat16; and a checkpoint's decoder gives the same
logits through either. By default triton's interpreter runs them on the CPU; under
`pytest --device cuda` (bench/gpu_check.py) they compile, and the decoder's test is left to the
GPU check's checkpoint comparisons with transformers.
"""

import os

from tests.conftest import worker_test_device

# before triton's import, where @triton.jit decides: interpreted on the CPU, compiled on CUDA
os.environ["TRITON_INTERPRET"] = "1" if worker_test_device() == "cpu" else "0"

from pathlib import Path

import pytest
import torch

from tests.unit.hf_checkpoints import QWEN3_MOE, our_logits, write_checkpoint
from worker.distributed import single_rank_group
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import RopeConfig
from worker.models.hf.decoder import HFDecoder
from worker.models.hf.fused_kernels import FusedLayerOps, norm_and_rotate_, silu_and_mul
from worker.models.hf.layer_ops import TorchLayerOps, check_fused_ops, layer_ops_for
from worker.models.hf.rope import Rotary
from worker.models.registry import get_model_info

CPU = torch.device("cpu")
DEVICE = torch.device(worker_test_device())
EPS = 1e-6
NUM_TOKENS = 7
HIDDEN_SIZE = 48  # not a power of two: the kernels mask the padded columns
HEAD_DIM = 12  # halves of 6, padded to 8
NUM_HEADS, NUM_KV_HEADS = 4, 2
DTYPES = [torch.float32, torch.bfloat16]
# float32: one ulp or so where a row's sum is taken in another order; bfloat16: one bf16 ulp
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
FUSED, TORCH = FusedLayerOps(), TorchLayerOps()

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded on the CPU, so that every device gets the same values; on DEVICE."""
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def _assert_close(result: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCES[expected.dtype]
    assert result.dtype == expected.dtype and result.shape == expected.shape
    torch.testing.assert_close(result, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_adds_into_the_residual_in_place_and_norms_the_sum(dtype: torch.dtype) -> None:
    x = _random(NUM_TOKENS, HIDDEN_SIZE, seed=1).to(dtype)
    residual = _random(NUM_TOKENS, HIDDEN_SIZE, seed=2, scale=3.0).to(dtype)
    weight = (1 + _random(HIDDEN_SIZE, seed=3, scale=0.2)).to(dtype)
    expected, expected_residual = TORCH.add_rms_norm(x, residual, weight, EPS)
    updated = residual.clone()
    result, returned = FUSED.add_rms_norm(x, updated, weight, EPS)
    assert returned is updated
    assert torch.equal(updated, expected_residual)  # one rounding of the sum, as torch's add
    _assert_close(result, expected)
    _assert_close(FUSED.rms_norm(residual, weight, EPS), TORCH.rms_norm(residual, weight, EPS))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy's
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_gates_the_up_half(dtype: torch.dtype) -> None:
    """Some gates pass -88, where e^-gate overflows float32 and silu is -0."""
    gate_up = _random(NUM_TOKENS, 2 * 40, seed=4, scale=40.0).to(dtype)
    assert float(gate_up[:, :40].min()) < -88
    _assert_close(silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up))


def _qkv_and_angles(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A merged qkv [T, (H + 2 KV) * head_dim], and cos, sin of positions 0, 5, 10, ..."""
    widths = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = _random(NUM_TOKENS, widths, seed=5, scale=2.0).to(dtype)
    rotary = Rotary(RopeConfig("default", theta=10_000.0), HEAD_DIM, DEVICE)
    cos, sin = rotary.cos_sin(torch.arange(NUM_TOKENS, device=DEVICE) * 5, dtype)
    return qkv, cos, sin


def _views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as the decoder takes them: strided views of the merged qkv."""
    q, k, v = qkv.split(
        [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1
    )
    return (
        q.view(NUM_TOKENS, NUM_HEADS, HEAD_DIM),
        k.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM),
        v.view(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM),
    )


@pytest.mark.parametrize("has_norm", [False, True], ids=["rotary", "qk-norm-rotary"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_and_rotate_rotates_q_and_k_in_place(dtype: torch.dtype, has_norm: bool) -> None:
    qkv, cos, sin = _qkv_and_angles(dtype)
    norms = (None, None)
    if has_norm:  # Qwen3's per-head weights
        norms = tuple((1 + _random(HEAD_DIM, seed=s, scale=0.3)).to(dtype) for s in (6, 7))
    q, k, v = _views(qkv.clone())
    expected_q, expected_k = TORCH.norm_and_rotate(q, k, *norms, EPS, cos, sin)
    q, k, v = _views(qkv.clone())
    norm_and_rotate_(q, k, *norms, EPS, cos, sin)
    _assert_close(q, expected_q)
    _assert_close(k, expected_k)
    assert torch.equal(v, _views(qkv)[2])  # v shares the buffer and stays as it was


def test_kernels_refuse_shapes_they_do_not_read() -> None:
    x, weight = _random(2, HIDDEN_SIZE, seed=8), _random(HIDDEN_SIZE, seed=9)
    with pytest.raises(ValueError, match="expected the same shape and dtype"):
        FUSED.add_rms_norm(x, _random(2, HIDDEN_SIZE + 1, seed=10), weight, EPS)
    with pytest.raises(ValueError, match="expected an even width"):
        silu_and_mul(_random(2, 7, seed=11))
    q, k = _random(2, NUM_HEADS, HEAD_DIM, seed=12), _random(2, NUM_KV_HEADS, HEAD_DIM, seed=13)
    angles = _random(3, HEAD_DIM, seed=14)
    with pytest.raises(ValueError, match=r"expected each \[2, 12\]"):
        norm_and_rotate_(q, k, None, None, EPS, angles, angles)


def test_kernels_are_taken_only_once_they_agree_with_torch_on_the_device() -> None:
    """Guards CUDA decoders against kernels never run on their card: a CUDA decoder checks the
    kernels at start-up, and one that raises (cannot compile there) or disagrees is refused
    with its reason, so the decoder runs torch's ops instead of failing."""

    class Raising(FusedLayerOps):
        def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no kernel for this card")

    class Wrong(FusedLayerOps):
        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return super().rms_norm(x, weight, eps) + 1

    assert check_fused_ops(FUSED, DEVICE) is None
    raised = check_fused_ops(Raising(), DEVICE)
    assert raised == "silu_and_mul raised RuntimeError: no kernel for this card"
    assert "rms_norm differs from torch's ops by 1" in str(check_fused_ops(Wrong(), DEVICE))
    assert isinstance(layer_ops_for(CPU), TorchLayerOps)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on CUDA, bench/gpu_check.py's checkpoint checks")
@pytest.mark.parametrize(
    ("arch", "fields"),
    [
        ("qwen3", dict(tie_word_embeddings=True)),
        ("llama", dict(attention_bias=True)),
        ("qwen3-moe", QWEN3_MOE),  # the experts through FusedLayerOps.moe
    ],
    ids=["qwen3-qk-norm", "llama-bias", "qwen3-moe"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_logits_through_the_kernels_match_the_torch_path(
    tmp_path: Path, arch: str, fields: dict, dtype: str
) -> None:
    """The residual carried between layers and updated in place gives the CPU path's logits."""
    write_checkpoint(tmp_path, arch, num_hidden_layers=2, **fields)
    config = check_checkpoint(str(tmp_path), 1)
    info = get_model_info(str(tmp_path), block_size=4)
    torch_dtype = getattr(torch, dtype)
    token_ids = list(range(3, 3 + NUM_TOKENS))
    logits = {
        name: our_logits(
            HFDecoder(config, single_rank_group(), CPU, torch_dtype, **kw), info, token_ids
        )
        for name, kw in {"torch": {}, "fused": dict(layer_ops=FUSED)}.items()
    }
    # logits of magnitude ~10: float32 keeps the kernels' ulps; bfloat16 allows one ulp there
    tolerance = 1e-5 if dtype == "float32" else 0.0625
    torch.testing.assert_close(logits["fused"], logits["torch"], rtol=tolerance, atol=tolerance)
