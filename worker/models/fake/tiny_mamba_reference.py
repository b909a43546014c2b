"""tiny-mamba-hybrid's reference: the next token's logits from a dense forward over the whole
sequence on one rank, its K/V in contiguous tensors and each recurrent state carried from zero
through every token in order. It never pages and never resumes from a stored state.
"""

from collections.abc import Callable

import torch

from worker.attention import ContextChunk
from worker.distributed import single_rank_group
from worker.mamba_state import DenseMambaState
from worker.models.fake.tiny_mamba import TINY_MAMBA_HYBRID, TinyMambaHybrid


class DenseCausalKV:
    """One whole sequence's K/V: entry i is position i, every query reads [0, its position]
    (the model's attention layers are all full attention). No blocks."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store[layer_name] = (k.double(), v.double())

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        positions = torch.arange(self.num_tokens)
        queries = positions[-1:] if logits_only else positions
        visible = positions[None, :] <= queries[:, None]  # [n, T]
        zeros = torch.zeros((1, self.num_tokens), dtype=torch.int64)  # [1, T]
        return [ContextChunk(queries[None, :], zeros, zeros, positions[None, :], visible[None])]

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.store[layer_name]
        return k[None], v[None]


def tiny_mamba_logits(seed: int) -> Callable[[list[int]], torch.Tensor]:
    """A function from a token sequence to the logits [V] of the token after it."""
    device = torch.device("cpu")
    model = TinyMambaHybrid(TINY_MAMBA_HYBRID, single_rank_group(), seed, device)
    state_shape = (TINY_MAMBA_HYBRID.num_channels, TINY_MAMBA_HYBRID.state_dim)

    def logits_of(sequence: list[int]) -> torch.Tensor:
        tokens = torch.tensor(sequence, dtype=torch.int64)
        positions = torch.arange(len(sequence), dtype=torch.int64)
        last = torch.tensor([len(sequence) - 1])
        kv = DenseCausalKV(len(sequence))
        states = DenseMambaState(len(sequence), state_shape, device)
        return model.forward_with_states(tokens, positions, last, kv, states)[0]

    return logits_of
