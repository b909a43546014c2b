"""tiny-llama: a small real decoder over the paged KV cache (RMSNorm, rotary, GQA, gated MLP).

Seeded weights; heads and MLP columns sharded over TP ranks, all-reduced after attention and MLP.
Fixed-point arithmetic (worker/numerics/fixed_point.py) makes tokens bit-identical for any TP
size, chunking, batch or block size. Optional sliding-window, chunked-local and R-SWA layers each
add a KV-cache group (tiny-llama-hybrid, tiny-local).
"""

from dataclasses import dataclass

import torch

from protocol.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from worker.attention import KVContext, PagedKV
from worker.cascade import cascade_attention
from worker.distributed import TPGroup
from worker.numerics.fixed_point import (
    MAX_CONTEXT_TOKENS,
    WEIGHT_FRAC_BITS,
    WEIGHT_INT_BITS,
    attend,
    exp_table,
    quantize,
    rms_norm,
    rotary_tables,
    rotate,
)


@dataclass(frozen=True, slots=True)
class TinyLlamaConfig:
    name: str
    vocab_size: int = 512
    hidden_size: int = 64  # a power of two, so the RMS mean is exact
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4  # divisible by every supported tp_size (1, 2, 4)
    head_dim: int = 16  # 1/sqrt(16) is exact
    intermediate_size: int = 128
    max_model_len: int = MAX_CONTEXT_TOKENS
    rope_base: float = 10000.0
    eos_token_id: int = 2
    sliding_window: int | None = None  # tokens, the current one included
    sliding_layers: tuple[int, ...] = ()  # layers that attend only within the window
    attention_chunk_size: int | None = None  # tokens per chunk of the chunked-local layers
    chunked_local_layers: tuple[int, ...] = ()  # layers that attend only within their chunk
    rswa_window: int | None = None  # tokens before the current one that R-SWA layers read
    rswa_layers: tuple[int, ...] = ()  # layers that read the prompt and a window (R-SWA)
    sliding_block_size_factor: int = 1  # the window group's blocks hold this many engine blocks

    def layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.attn"

    def kv_cache_groups(self, block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
        """Full-attention layers first, then one group per other kind that the model has:
        sliding window, chunked local, R-SWA."""
        dims = dict(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )
        local: list[tuple[tuple[int, ...], KVCacheSpec]] = []
        if self.sliding_layers:
            window = self._size(self.sliding_window, "sliding_window")
            # A factor above 1 gives the window group larger blocks than the others (mixed block
            # sizes: the engine hashes at --block-size, the gcd, and the window reads a view).
            window_dims = {**dims, "block_size": block_size * self.sliding_block_size_factor}
            spec = SlidingWindowSpec(**window_dims, sliding_window=window)
            local.append((self.sliding_layers, spec))
        if self.chunked_local_layers:
            chunk = self._size(self.attention_chunk_size, "attention_chunk_size")
            spec = ChunkedLocalAttentionSpec(**dims, attention_chunk_size=chunk)
            local.append((self.chunked_local_layers, spec))
        if self.rswa_layers:
            window = self._size(self.rswa_window, "rswa_window")
            local.append((self.rswa_layers, RSWASpec(**dims, rswa_window=window)))
        local_layers = {i for layers, _ in local for i in layers}
        full = tuple(i for i in range(self.num_layers) if i not in local_layers)
        groups = [(full, FullAttentionSpec(**dims)), *local]
        return [
            KVCacheGroupSpec([self.layer_name(i) for i in sorted(layers)], spec)
            for layers, spec in groups
        ]

    def _size(self, size: int | None, field_name: str) -> int:
        if size is None:
            raise ValueError(f"model {self.name} has layers that need {field_name}, which is None")
        return size


TINY_LLAMA = TinyLlamaConfig("tiny-llama")
TINY_LLAMA_HYBRID = TinyLlamaConfig("tiny-llama-hybrid", sliding_window=48, sliding_layers=(1, 3))
# tiny-llama-hybrid whose window group uses blocks twice --block-size: groups of two block sizes.
TINY_LLAMA_HYBRID_2X = TinyLlamaConfig(
    "tiny-llama-hybrid-2x", sliding_window=48, sliding_layers=(1, 3), sliding_block_size_factor=2
)
# Three KV-cache groups: full attention (layers 0 and 3), chunked local (1) and R-SWA (2). The
# chunk is a multiple of every block size the tests use (1, 4, 16, 32), as the manager requires.
TINY_LOCAL = TinyLlamaConfig(
    "tiny-local",
    attention_chunk_size=32,
    chunked_local_layers=(1,),
    rswa_window=24,
    rswa_layers=(2,),
)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights on this rank (its heads and MLP columns), float64 on the grid."""

    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, heads_per_rank * head_dim]
    wk: torch.Tensor  # [D, kv_heads_per_rank * head_dim]
    wv: torch.Tensor  # [D, kv_heads_per_rank * head_dim]
    wo: torch.Tensor  # [heads_per_rank * head_dim, D]
    mlp_norm: torch.Tensor  # [D]
    w_gate: torch.Tensor  # [D, intermediate_per_rank]
    w_up: torch.Tensor  # [D, intermediate_per_rank]
    w_down: torch.Tensor  # [intermediate_per_rank, D]


def _weight(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * std
    return quantize(values, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS)


def _norm_gain(gen: torch.Generator, size: int) -> torch.Tensor:
    return _weight(gen, (size,), 0.1) + 1.0


class TinyLlama:
    """The decoder on one TP rank. Token rule: greedy or sampled from exact fixed-point logits.

    Invariants: the rank owns KV heads [rank * G_r, (rank + 1) * G_r) and their query heads, and
    MLP columns [rank * I_r, (rank + 1) * I_r); embedding, norms and lm_head are replicated.
    """

    def __init__(
        self, config: TinyLlamaConfig, tp_group: TPGroup, seed: int, device: torch.device
    ) -> None:
        tp_size = tp_group.tp_size
        if config.num_kv_heads % tp_size or config.intermediate_size % tp_size:
            raise ValueError(
                f"{config.name} cannot be split over tp_size={tp_size}: num_kv_heads="
                f"{config.num_kv_heads}, intermediate_size={config.intermediate_size}"
            )
        self.config = config
        self.tp_group = tp_group
        self.vocab_size = config.vocab_size
        self.kv_heads_per_rank = config.num_kv_heads // tp_size
        self.heads_per_rank = config.num_heads // tp_size
        gen = torch.Generator().manual_seed(seed)
        dim = config.hidden_size
        embed = torch.randn((config.vocab_size, dim), generator=gen, dtype=torch.float64)
        self.embed = quantize(embed).to(device)  # [V, D]
        self.layers = [self._layer(gen, device) for _ in range(config.num_layers)]
        self.final_norm = _norm_gain(gen, dim).to(device)  # [D]
        self.lm_head = _weight(gen, (dim, config.vocab_size), dim**-0.5).to(device)  # [D, V]
        self.cos, self.sin = rotary_tables(
            config.max_model_len, config.head_dim, config.rope_base, device
        )  # each [max_model_len, head_dim / 2]
        self.exp_table = exp_table(device)

    def check_invariants(self) -> None:
        cfg, hd = self.config, self.config.head_dim
        for idx, layer in enumerate(self.layers):
            assert layer.wq.shape == (cfg.hidden_size, self.heads_per_rank * hd), f"layer {idx} wq"
            assert layer.wk.shape == (cfg.hidden_size, self.kv_heads_per_rank * hd), (
                f"layer {idx} wk"
            )
            assert layer.wo.shape == (self.heads_per_rank * hd, cfg.hidden_size), f"layer {idx} wo"
            weights = (
                layer.wq,
                layer.wk,
                layer.wv,
                layer.wo,
                layer.w_gate,
                layer.w_up,
                layer.w_down,
            )
            for weight in weights:
                on_grid = quantize(weight, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS)
                assert torch.equal(weight, on_grid), f"layer {idx} has a weight off the grid"

    def _layer(self, gen: torch.Generator, device: torch.device) -> LayerWeights:
        """Draw the full layer (the same on every rank), then keep this rank's shard."""
        cfg, rank = self.config, self.tp_group.rank
        dim, hd = cfg.hidden_size, cfg.head_dim
        q_cols = slice(rank * self.heads_per_rank * hd, (rank + 1) * self.heads_per_rank * hd)
        kv_cols = slice(
            rank * self.kv_heads_per_rank * hd, (rank + 1) * self.kv_heads_per_rank * hd
        )
        mlp_cols = cfg.intermediate_size // self.tp_group.tp_size
        mlp = slice(rank * mlp_cols, (rank + 1) * mlp_cols)
        full = dict(
            attn_norm=_norm_gain(gen, dim),
            wq=_weight(gen, (dim, cfg.num_heads * hd), dim**-0.5)[:, q_cols],
            wk=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5)[:, kv_cols],
            wv=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5)[:, kv_cols],
            wo=_weight(gen, (cfg.num_heads * hd, dim), (cfg.num_heads * hd) ** -0.5)[q_cols],
            mlp_norm=_norm_gain(gen, dim),
            w_gate=_weight(gen, (dim, cfg.intermediate_size), dim**-0.5)[:, mlp],
            w_up=_weight(gen, (dim, cfg.intermediate_size), dim**-0.5)[:, mlp],
            w_down=_weight(gen, (cfg.intermediate_size, dim), cfg.intermediate_size**-0.5)[mlp],
        )
        return LayerWeights(**{k: v.contiguous().to(device) for k, v in full.items()})

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """Logits [S, V] (float64) of the tokens `logits_idx` after writing every token's K/V.

        Args:
            token_ids, positions: [T] int64, the step's flattened tokens.
            logits_idx: [S] indices into T of the tokens to produce logits for.
        """
        x = self.embed[token_ids]  # [T, D]
        cos, sin = self.cos[positions], self.sin[positions]
        last = len(self.layers) - 1
        for layer_idx, layer in enumerate(self.layers):
            attn = self._attention(layer_idx, layer, x, cos, sin, kv, layer_idx == last)
            if layer_idx == last:  # only the sampled tokens matter past the last K/V write
                x, attn = x[logits_idx], attn[logits_idx]
            x = quantize(x + self.tp_group.all_reduce(attn @ layer.wo))
            x = quantize(x + self.tp_group.all_reduce(self._mlp(layer, x)))
        if not self.layers:
            x = x[logits_idx]
        return quantize(rms_norm(x, self.final_norm) @ self.lm_head)

    def _attention(
        self,
        layer_idx: int,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVContext,
        logits_only: bool,
    ) -> torch.Tensor:
        """This rank's heads: write K/V of every token, then attend; returns [T, H_r * head_dim]."""
        num_tokens, hd = x.shape[0], self.config.head_dim
        h = rms_norm(x, layer.attn_norm)
        q = rotate(quantize(h @ layer.wq).view(num_tokens, self.heads_per_rank, hd), cos, sin)
        k = rotate(quantize(h @ layer.wk).view(num_tokens, self.kv_heads_per_rank, hd), cos, sin)
        v = quantize(h @ layer.wv).view(num_tokens, self.kv_heads_per_rank, hd)
        name = self.config.layer_name(layer_idx)
        kv.write(name, k, v)  # before any read: a same-step neighbour may share these blocks
        if isinstance(kv, PagedKV) and kv.num_cascade_tokens(name):  # a prefix all requests share
            return cascade_attention(kv, name, q, logits_only, self.exp_table)
        out = x.new_zeros((num_tokens, self.heads_per_rank * hd))  # [T, H_r * head_dim]
        for chunk in kv.chunks(name, logits_only):
            k_ctx, v_ctx = kv.gather(name, chunk)
            result = attend(
                q[chunk.query_idx], k_ctx.double(), v_ctx.double(), chunk.mask, self.exp_table
            )  # [S, n, H_r * head_dim]
            out[chunk.query_idx.reshape(-1)] = result.reshape(-1, out.shape[1])
        return out

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """This rank's MLP columns; returns its exact partial sum [T, D] before the all-reduce."""
        h = rms_norm(x, layer.mlp_norm)
        gate = quantize(h @ layer.w_gate)
        up = quantize(h @ layer.w_up)
        return quantize(torch.relu(gate) * up) @ layer.w_down
