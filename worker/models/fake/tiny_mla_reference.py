"""tiny-mla's reference: the next token's logits from a dense causal forward over the whole
sequence, its latents in one contiguous store (no blocks, no slots, one rank). It never pages."""

from collections.abc import Callable

import torch

from worker.distributed import single_rank_group
from worker.latent_attention import DenseLatentKV
from worker.models.fake.tiny_mla import TINY_MLA, TinyMLA


def tiny_mla_logits(seed: int) -> Callable[[list[int]], torch.Tensor]:
    """A function from a token sequence to the logits [V] of the token after it."""
    model = TinyMLA(TINY_MLA, single_rank_group(), seed, torch.device("cpu"))

    def logits_of(sequence: list[int]) -> torch.Tensor:
        tokens = torch.tensor(sequence, dtype=torch.int64)
        positions = torch.arange(len(sequence), dtype=torch.int64)
        last = torch.tensor([len(sequence) - 1])
        return model.forward_latent(tokens, positions, last, DenseLatentKV(len(sequence)))[0]

    return logits_of
