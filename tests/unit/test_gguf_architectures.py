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
from tests.unit.gguf_files import ARCH_FIELDS, hf_gguf_model, write_arch_gguf
from tests.unit.hf_checkpoints import hf_greedy
from tests.unit.test_hf_generate import PROMPTS, assert_greedy_matches, workload
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.config import CheckpointError
from worker.models.hf.gguf_file import read_tensor

CPU = torch.device("cpu")
MAX_TOKENS = 10
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
