"""The model registry: a name gives the ModelInfo the engine plans with, and the model a rank runs.

Names: `checksum`, `tiny-llama` and `tiny-llama-hybrid` (full plus sliding-window layers, two
KV-cache groups). kv_cache_groups report the whole model's num_kv_heads, before TP sharding.
tiny-llama's cached values are exact in float32 and float64; float16 and bfloat16 round them.
"""

from typing import Protocol

import torch

from protocol.worker_messages import ModelInfo
from worker.attention import KVContext
from worker.distributed import TPGroup
from worker.models.checksum import CHECKSUM, ChecksumModel
from worker.models.tiny_llama import TINY_LLAMA, TINY_LLAMA_HYBRID, TinyLlama, TinyLlamaConfig

TINY_LLAMAS: dict[str, TinyLlamaConfig] = {
    TINY_LLAMA.name: TINY_LLAMA,
    TINY_LLAMA_HYBRID.name: TINY_LLAMA_HYBRID,
}
MODEL_NAMES = (CHECKSUM.name, *TINY_LLAMAS)


class Model(Protocol):
    """A model on one TP rank: writes every token's K/V, returns logits of the sampled tokens."""

    vocab_size: int

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor: ...


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}: expected one of {list(MODEL_NAMES)}")


def get_model_info(name: str, block_size: int, dtype: str = "float32") -> ModelInfo:
    """What the engine needs to plan: vocabulary, EOS, max length and the KV-cache groups.

    `dtype` is the KV-cache dtype of tiny-llama; checksum always stores int64 values.
    """
    _check_name(name)
    if name == CHECKSUM.name:
        config = CHECKSUM
        groups = config.kv_cache_groups(block_size)
    else:
        config = TINY_LLAMAS[name]
        groups = config.kv_cache_groups(block_size, dtype)
    return ModelInfo(
        name=name,
        vocab_size=config.vocab_size,
        eos_token_id=config.eos_token_id,
        max_model_len=config.max_model_len,
        kv_cache_groups=groups,
    )


def build_model(name: str, tp_group: TPGroup, device: torch.device, seed: int = 0) -> Model:
    """The model `name` on this rank; every rank of a group must pass the same seed."""
    _check_name(name)
    if name == CHECKSUM.name:
        return ChecksumModel(CHECKSUM, tp_group, device)
    return TinyLlama(TINY_LLAMAS[name], tp_group, seed, device)
