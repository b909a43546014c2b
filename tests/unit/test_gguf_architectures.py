"""GGUF files beyond Llama: Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 2 and 3 (norms stored
as 1 + weight, sandwich norms, sliding layers), Phi-3 (fused qkv and gate/up) and Qwen3-MoE
(experts stacked in one tensor per projection), each written by the gguf library from a random
transformers model in Q8_0 with F16 and F32 tensors. Greedy tokens served from the file equal
transformers' generate() on its own reading of the same file, at TP 1 and 2 (ranks as threads,
each dequantizing its own slices), with prefix caching and chunked prefill.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench.workload import run_workload
from tests.unit.gguf_files import ARCH_FIELDS, hf_gguf_model, round_tripped, write_arch_gguf
from tests.unit.hf_checkpoints import hf_greedy, hf_logits, our_logits
from tests.unit.test_hf_generate import PROMPTS, assert_greedy_matches, workload
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import CheckpointError
from worker.models.hf.gguf_file import read_tensor
from worker.models.registry import build_model, get_model_info

CPU = torch.device("cpu")
MAX_TOKENS = 10
# float32 logits of ~20: the long factors turn angles up to 90 rad, where one float32 step is
# 8e-6, and transformers' own float32 logits differ from its float64 ones by 4e-4 there
LONGROPE_ATOL = 5e-3
TP2_ARCHS = ("qwen3", "gemma3", "phi3", "qwen3moe")  # Phi-3's fused rows, experts split

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list]]:
    """Each arch's file and transformers' greedy (tokens, margins) of every prompt on it."""
    made = {}
    for arch in ARCH_FIELDS:
        path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf"
        write_arch_gguf(path, arch, seed=3)
        model = hf_gguf_model(path)
        made[arch] = (path, [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS])
    return made


@pytest.mark.parametrize("arch", list(ARCH_FIELDS))
def test_greedy_tokens_equal_transformers_on_the_same_file(gguf_files: dict, arch: str) -> None:
    path, references = gguf_files[arch]
    work = workload(path, max_num_batched_tokens=12, async_scheduling=True)
    result = run_workload(work, single_rank_group(), CPU)
    assert result.num_hit_tokens > 0
    assert_greedy_matches(f"gguf-{arch}", result, references)


@pytest.mark.parametrize("arch", TP2_ARCHS)
def test_tp2_ranks_dequantize_their_slices(gguf_files: dict, arch: str) -> None:
    path, references = gguf_files[arch]
    work = workload(path, max_num_batched_tokens=16, async_scheduling=True)
    rank0, rank1 = run_ranks(2, lambda group: run_workload(work, group, CPU))
    assert rank0.outputs == rank1.outputs
    assert_greedy_matches(f"gguf-{arch}-tp2", rank0, references)


def test_each_file_reads_as_its_architecture(gguf_files: dict) -> None:
    expected = {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "qwen3moe": "Qwen3MoeForCausalLM",
    }
    for arch, (path, _) in gguf_files.items():
        config = check_checkpoint(str(path), 2)
        assert config.architecture == expected[arch]
    gemma3 = check_checkpoint(str(gguf_files["gemma3"][0]), 1)
    assert gemma3.sliding_windows == (8,) * 5 + (None,)  # every 6th layer global
    moe = check_checkpoint(str(gguf_files["qwen3moe"][0]), 1).moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)


def test_gemma_norms_lose_the_stored_one(gguf_files: dict) -> None:
    """llama.cpp stores Gemma's norm weights as 1 + weight; they are read back as the weight."""
    path, _ = gguf_files["gemma2"]
    by_name = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    stored = np.asarray(by_name["blk.0.post_ffw_norm.weight"].data)
    read = read_tensor(str(path), "model.layers.0.post_feedforward_layernorm.weight")
    np.testing.assert_array_equal(read, stored - 1.0)


def test_an_unreadable_type_in_a_stacked_expert_tensor_is_refused_by_name(
    gguf_files: dict, tmp_path: Path
) -> None:
    """The whole file copied with one stacked experts tensor's type renamed to IQ2_XXS."""
    path, _ = gguf_files["qwen3moe"]
    reader = gguf.GGUFReader(str(path))
    (tensor,) = [t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight"]
    data = bytearray(path.read_bytes())
    # the tensor-info record: name, dimensions, then its type (u32) before the offset (u64)
    name = tensor.name.encode()
    at = data.index(name) + len(name) + 4 + 8 * len(tensor.shape)
    assert int.from_bytes(data[at : at + 4], "little") == gguf.GGMLQuantizationType.Q8_0
    data[at : at + 4] = int(gguf.GGMLQuantizationType.IQ2_XXS).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_down_exps\.weight has type IQ2_XXS"):
        check_checkpoint(str(odd), 1)


def test_a_phi3_file_with_one_longrope_factor_set_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "longrope.gguf"
    factors = np.ones(32, dtype=np.float32)
    write_arch_gguf(path, "phi3", extra_tensors={"rope_factors_long.weight": factors})
    with pytest.raises(CheckpointError, match=r"rope_factors_short\.weight"):
        check_checkpoint(str(path), 1)


@pytest.mark.parametrize("num_tokens", [40, 90])
def test_a_phi3_longrope_file_equals_its_checkpoint_after_the_same_rounding(
    tmp_path: Path, num_tokens: int
) -> None:
    """llama.cpp's Phi-3 longrope (factors as tensors, the pretraining context and attention
    factor as metadata), which transformers' GGUF reader drops: compared with the transformers
    model it was written from, its weights quantized and dequantized as the file holds them,
    within the original context (64) and past it (rope.Rotary's choice by max_model_len)."""
    path = tmp_path / "phi3-longrope.gguf"
    longrope = {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(32)],
        "long_factor": [1.0 + 0.5 * i for i in range(32)],
    }
    model = write_arch_gguf(
        path, "phi3", seed=4, rope_scaling=longrope, original_max_position_embeddings=64
    )
    reference = round_tripped(model)
    rope = check_checkpoint(str(path), 1).rope
    assert (rope.rope_type, rope.original_max_position_embeddings) == ("longrope", 64)
    generator = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randint(3, 300, (num_tokens,), generator=generator).tolist()
    info = get_model_info(str(path), 4, "float32", 1)
    expected = hf_logits(reference, tokens)
    logits = {}
    for max_model_len in (64, 90):  # the short factors, then the long ones
        model = build_model(str(path), single_rank_group(), CPU, max_model_len=max_model_len)
        logits[max_model_len] = our_logits(model, info, tokens)
    chosen, other = (64, 90) if num_tokens <= 64 else (90, 64)
    torch.testing.assert_close(logits[chosen], expected, atol=LONGROPE_ATOL, rtol=0)
    assert (logits[other] - expected).abs().max() > 0.1  # the set chosen is what agrees
