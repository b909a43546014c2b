"""Tiny random-weight Hugging Face checkpoints for the checkpoint tests, written with transformers
(a test-only dependency), and the references the tests compare with: transformers' own logits
and greedy generate().
"""

import copy
from pathlib import Path

import pytest
import torch
import transformers

from protocol.worker_messages import ModelInfo
from worker.attention import ContextChunk
from worker.models.fake.reference import DenseKV
from worker.models.model import Model

INITIALIZER_RANGE = 0.3  # large enough that the context, not only the last token, sets the logits
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=INITIALIZER_RANGE,
    eos_token_id=2,
    bos_token_id=1,
)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
}
# Gemma initialises its (1 + weight) norms to zero: these archs get random norm weights, so that
# a norm read as Llama's (weight alone) or without its weight cannot pass
RANDOM_NORM_ARCHS = ("gemma2", "gemma3")
GEMMA_SMALL = dict(head_dim=16, query_pre_attn_scalar=24, pad_token_id=0)  # scale != 1/sqrt(16)
GEMMA2_ALTERNATING = dict(  # layers 0 and 2 slide, 1 is global; soft-caps low enough to bite
    GEMMA_SMALL,
    num_hidden_layers=3,
    sliding_window=6,
    attn_logit_softcapping=4.0,
    final_logit_softcapping=8.0,
)
GEMMA3_FIVE_TO_ONE = dict(  # layers 0-4 slide, layer 5 is global with its own rope
    GEMMA_SMALL,
    num_hidden_layers=6,
    sliding_window=6,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    rope_local_base_freq=100.0,
    rope_theta=20000.0,
    final_logit_softcapping=8.0,
)
# Longer than the shared test sequences (served with max_model_len within it: the short factors,
# as transformers uses them); the long-prompt tests pass it (rope.Rotary explains the choice)
PHI3_ORIGINAL_LEN = 64
PHI3_PARTIAL = dict(  # half of each head rotates
    partial_rotary_factor=0.5,
    original_max_position_embeddings=PHI3_ORIGINAL_LEN,
    rope_scaling={
        "type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0],
    },
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
QWEN3_MIXED_LAYERS = dict(  # a sliding-window layer between two full-attention layers
    num_hidden_layers=3,
    layer_types=["full_attention", "sliding_attention", "full_attention"],
    use_sliding_window=True,
    sliding_window=6,
)
# 8 experts of 32, 2 a token, renormalised, behind a dense first layer (BASE's MLP of 128)
QWEN3_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=[0],
    norm_topk_prob=True,
)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)  # every layer, experts of 128
Cases = dict[str, tuple[str, dict]]  # case name -> (arch, the fields BASE is overridden by)


def write_checkpoint(
    folder: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **fields: object
) -> transformers.PreTrainedModel:
    """Save a random float32 model of `arch` (BASE overridden by `fields`); the model, in eval."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(**{**BASE, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch in RANDOM_NORM_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, INITIALIZER_RANGE)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def write_checkpoints(
    tmp_path_factory: pytest.TempPathFactory, cases: Cases, seed: int = 0
) -> dict[str, tuple[Path, transformers.PreTrainedModel]]:
    """Each case's checkpoint in a folder of its own: the folder and the model, by case name."""
    made = {}
    for name, (arch, fields) in cases.items():
        folder = tmp_path_factory.mktemp(name)
        made[name] = (folder, write_checkpoint(folder, arch, seed, **copy.deepcopy(fields)))
    return made


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, V] float32 of every position of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(
    model: transformers.PreTrainedModel, prompt: list[int], num_tokens: int
) -> tuple[list[int], list[float]]:
    """generate()'s greedy tokens (no EOS stop) and each step's top-2 logit margin."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


class EveryQueryKV(DenseKV):
    """DenseKV whose last layer attends for every position too, so one dense forward gives
    teacher-forced logits of the whole sequence."""

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        return super().chunks(layer_name, False)


def our_logits(model: Model, info: ModelInfo, token_ids: list[int]) -> torch.Tensor:
    """Our decoder's logits [T, V] of every position, from one unpaged forward."""
    specs = {name: group.spec for group in info.kv_cache_groups for name in group.layer_names}
    num_tokens = len(token_ids)
    positions = torch.arange(num_tokens)
    kv = EveryQueryKV(num_tokens, specs)
    with torch.no_grad():
        return model.forward(torch.tensor(token_ids), positions, positions, kv)
