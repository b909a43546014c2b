"""tiny-mamba-hybrid: tiny-llama's decoder with some attention layers replaced by recurrent state
layers (as Jamba mixes attention and Mamba), the state of each kept in the pool's Mamba blocks.

A recurrent layer runs an exact fixed-point linear recurrence per channel c and state index n:
h_t[c, n] = q(a[c, n] * h_{t-1}[c, n] + b[c, n] * u_t[c]), y_t[c] = q(sum_n w_c[c, n] * h_t[c, n]),
q the activation grid (worker/numerics/fixed_point.py), so the state after a prefix is the same
however the prefix was chunked. Channels are split over TP ranks and the output projection
all-reduced, as tiny-llama splits its MLP, so tokens are bit-identical for any TP size.
"""

from dataclasses import dataclass

import numpy as np
import torch

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from worker.attention import KVContext, PagedKV
from worker.distributed import TPGroup
from worker.mamba_state import MambaStateContext, PagedMambaState
from worker.models.fake.tiny_llama import TinyLlama, TinyLlamaConfig
from worker.numerics.fixed_point import WEIGHT_FRAC_BITS, WEIGHT_INT_BITS, quantize, rms_norm

MAMBA_SEED_OFFSET = 7919  # the recurrent weights' generator seed, apart from tiny-llama's draws
MIN_DECAY = 0.6  # each state value keeps this share of itself per token, at least ...
MAX_DECAY = 0.99  # ... and at most, so a state remembers tens of tokens


@dataclass(frozen=True, slots=True)
class TinyMambaConfig:
    name: str
    llama: TinyLlamaConfig  # embedding, attention, MLP and head; its mamba_layers mix by recurrence
    mamba_layers: tuple[int, ...] = (1, 3)
    num_channels: int = 64  # recurrent channels, divisible by every supported tp_size (1, 2, 4)
    state_dim: int = 4  # state values per channel
    mamba_cache_mode: str = "align"  # checkpoints for prefix hits; one block without a cache

    @property
    def vocab_size(self) -> int:
        return self.llama.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.llama.eos_token_id

    @property
    def max_model_len(self) -> int:
        return self.llama.max_model_len

    def mamba_layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.mamba"

    def kv_cache_groups(self, block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
        """The attention layers' full-attention group, then the recurrent layers' Mamba group,
        whose checkpoint spacing is the block size."""
        llama = self.llama
        attention = [i for i in range(llama.num_layers) if i not in self.mamba_layers]
        full = FullAttentionSpec(block_size, llama.num_kv_heads, llama.head_dim, dtype)
        shape = ((self.num_channels, self.state_dim),)
        mamba = MambaSpec(block_size, shape, dtype, mamba_cache_mode=self.mamba_cache_mode)
        return [
            KVCacheGroupSpec([llama.layer_name(i) for i in attention], full),
            KVCacheGroupSpec([self.mamba_layer_name(i) for i in self.mamba_layers], mamba),
        ]


TINY_MAMBA_HYBRID = TinyMambaConfig("tiny-mamba-hybrid", TinyLlamaConfig("tiny-mamba-hybrid"))


@dataclass(slots=True)
class MambaWeights:
    """One recurrent layer's weights on this rank (its channels), float64 on the grids."""

    norm: torch.Tensor  # [D]
    w_in: torch.Tensor  # [D, C_r]
    decay: torch.Tensor  # [C_r, N] a, in [MIN_DECAY, MAX_DECAY]
    w_b: torch.Tensor  # [C_r, N]
    w_c: torch.Tensor  # [C_r, N]
    w_out: torch.Tensor  # [C_r, D]


class TinyMambaHybrid(TinyLlama):
    """tiny-llama whose `mamba_layers` mix tokens by recurrence instead of attention.

    Token rule: tiny-llama's, with each recurrent layer's output y (above) in place of attention.
    The attention weights of recurrent layers are drawn but never used, so every other weight
    equals tiny-llama's. Invariants beside tiny-llama's: the rank owns channels
    [rank * C_r, (rank + 1) * C_r) of every recurrent layer.
    """

    def __init__(
        self, config: TinyMambaConfig, tp_group: TPGroup, seed: int, device: torch.device
    ) -> None:
        if config.num_channels % tp_group.tp_size:
            raise ValueError(
                f"{config.name} cannot be split over tp_size={tp_group.tp_size}: "
                f"num_channels={config.num_channels}"
            )
        super().__init__(config.llama, tp_group, seed, device)
        self.mamba_config = config
        gen = torch.Generator().manual_seed(seed + MAMBA_SEED_OFFSET)
        self.mamba = {idx: self._mamba_layer(gen, device) for idx in config.mamba_layers}

    def _mamba_layer(self, gen: torch.Generator, device: torch.device) -> MambaWeights:
        """Draw the whole layer (the same on every rank), then keep this rank's channels."""
        cfg, rank = self.mamba_config, self.tp_group.rank
        dim, channels, state_dim = self.config.hidden_size, cfg.num_channels, cfg.state_dim
        per_rank = channels // self.tp_group.tp_size
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        decay = torch.rand((channels, state_dim), generator=gen, dtype=torch.float64)
        full = dict(
            norm=_weight(gen, (dim,), 0.1) + 1.0,
            w_in=_weight(gen, (dim, channels), dim**-0.5)[:, mine],
            decay=_on_weight_grid(MIN_DECAY + decay * (MAX_DECAY - MIN_DECAY))[mine],
            w_b=_weight(gen, (channels, state_dim), 0.1)[mine],  # keeps y near unit size
            w_c=_weight(gen, (channels, state_dim), 1.0)[mine],
            w_out=_weight(gen, (channels, dim), channels**-0.5)[mine],
        )
        return MambaWeights(**{k: v.contiguous().to(device) for k, v in full.items()})

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """Logits [S, V] (float64) of the tokens `logits_idx`, its states in the paged pool."""
        if not isinstance(kv, PagedKV):
            raise TypeError(f"{self.config.name} pages its states through a PagedKV, got {kv!r}")
        return self.forward_with_states(token_ids, positions, logits_idx, kv, PagedMambaState(kv))

    def forward_with_states(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
        states: MambaStateContext,
    ) -> torch.Tensor:
        """As tiny-llama's forward; the recurrent layers load and store through `states`."""
        x = self.embed[token_ids]  # [T, D]
        cos, sin = self.cos[positions], self.sin[positions]
        last = len(self.layers) - 1
        for layer_idx, layer in enumerate(self.layers):
            is_last = layer_idx == last
            if layer_idx in self.mamba:
                mamba = self.mamba[layer_idx]
                mixed, w_out = self._recurrence(layer_idx, mamba, x, states), mamba.w_out
            else:
                mixed = self._attention(layer_idx, layer, x, cos, sin, kv, is_last)
                w_out = layer.wo
            if is_last:  # only the sampled tokens matter past the last state and K/V write
                x, mixed = x[logits_idx], mixed[logits_idx]
            x = quantize(x + self.tp_group.all_reduce(mixed @ w_out))
            x = quantize(x + self.tp_group.all_reduce(self._mlp(layer, x)))
        return quantize(rms_norm(x, self.final_norm) @ self.lm_head)

    def _recurrence(
        self, layer_idx: int, mamba: MambaWeights, x: torch.Tensor, states: MambaStateContext
    ) -> torch.Tensor:
        """This rank's channels: y [T, C_r] of every token, every request's state carried from
        its loaded start through its tokens in order, then stored."""
        name = self.mamba_config.mamba_layer_name(layer_idx)
        u = quantize(rms_norm(x, mamba.norm) @ mamba.w_in)  # [T, C_r]
        h = states.load_states(name)  # [R, C_r, N], every load of the step before any store
        offsets, counts = states.token_ranges()
        y = torch.zeros_like(u)  # [T, C_r]
        for step_idx in range(int(counts.max(initial=0))):
            reqs = np.flatnonzero(counts > step_idx)  # requests with a token at this step
            req_idx = torch.from_numpy(reqs).to(u.device)
            token_idx = torch.from_numpy(offsets[reqs] + step_idx).to(u.device)
            h_next = quantize(mamba.decay * h[req_idx] + mamba.w_b * u[token_idx][:, :, None])
            h[req_idx] = h_next
            y[token_idx] = quantize((h_next * mamba.w_c).sum(dim=-1))
        states.store_states(name, h)
        return y


def _on_weight_grid(values: torch.Tensor) -> torch.Tensor:
    return quantize(values, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS)


def _weight(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return _on_weight_grid(torch.randn(shape, generator=gen, dtype=torch.float64) * std)
