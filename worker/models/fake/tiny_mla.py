"""tiny-mla: a small decoder whose attention caches one latent per token (multi-head latent
attention, as DeepSeek-V2 introduced it) instead of per-head K and V.

Each layer down-projects the hidden state into a compressed K/V vector and a rotary key shared by
every head, caches both as the latent, and at attention time up-projects the gathered latents into
each head's key and value. Query heads and MLP columns are sharded over TP ranks and all-reduced as
tiny-llama does; the latent is computed and cached whole on every rank. Fixed-point arithmetic
(worker/numerics/fixed_point.py) keeps tokens bit-identical for any TP size, chunking, batch or
block size.
"""

from dataclasses import dataclass

import torch

from protocol.kv_cache_spec import KVCacheGroupSpec, MLAAttentionSpec
from worker.attention import ContextChunk, KVContext, PagedKV
from worker.cascade import attend_with_shared_prefix, prefix_block_ids
from worker.distributed import TPGroup
from worker.latent_attention import LatentContext, PagedLatentKV
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
class TinyMLAConfig:
    name: str
    vocab_size: int = 512
    hidden_size: int = 64  # a power of two, so the RMS mean is exact
    num_layers: int = 4
    num_heads: int = 8  # query heads, divisible by every supported tp_size (1, 2, 4)
    head_dim: int = 16  # query, key and value width per head; 1/sqrt(16) is exact
    rotary_dim: int = 8  # the key's rotary part, one for all heads, cached in the latent
    compressed_kv_dim: int = 32  # the down-projected K/V (DeepSeek's kv_lora_rank); a power of two
    intermediate_size: int = 128
    max_model_len: int = MAX_CONTEXT_TOKENS
    rope_base: float = 10000.0
    eos_token_id: int = 2

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the compressed K/V, then the rotary key."""
        return self.compressed_kv_dim + self.rotary_dim

    @property
    def content_dim(self) -> int:
        """The key's part up-projected from the compressed K/V, per head."""
        return self.head_dim - self.rotary_dim

    def layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.attn"

    def kv_cache_groups(self, block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
        """One group: every layer is MLA, attending to the whole prefix."""
        spec = MLAAttentionSpec(block_size=block_size, latent_dim=self.latent_dim, dtype=dtype)
        names = [self.layer_name(i) for i in range(self.num_layers)]
        return [KVCacheGroupSpec(names, spec)]


TINY_MLA = TinyMLAConfig("tiny-mla")


@dataclass(slots=True)
class MLALayerWeights:
    """One layer's weights on this rank, float64 on the grid: the down-projections and norms are
    replicated, the query, up-projections, output and MLP columns hold this rank's heads only."""

    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, heads_per_rank * head_dim], each head's content part then rotary part
    w_kv_down: torch.Tensor  # [D, compressed_kv_dim]
    kv_norm: torch.Tensor  # [compressed_kv_dim]
    w_k_rotary: torch.Tensor  # [D, rotary_dim]
    w_k_up: torch.Tensor  # [compressed_kv_dim, heads_per_rank * content_dim]
    w_v_up: torch.Tensor  # [compressed_kv_dim, heads_per_rank * head_dim]
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


def _head_columns(rank: int, heads_per_rank: int, width: int) -> slice:
    """The columns of this rank's heads in a matrix of `width` columns per head."""
    return slice(rank * heads_per_rank * width, (rank + 1) * heads_per_rank * width)


class TinyMLA:
    """The MLA decoder on one TP rank. Token rule: greedy or sampled from exact fixed-point logits.

    Invariants: the rank owns query heads [rank * H_r, (rank + 1) * H_r), their up-projection and
    output rows, and MLP columns [rank * I_r, (rank + 1) * I_r); embedding, norms, the latent's
    down-projections and lm_head are replicated, so every rank caches the same latent.
    """

    def __init__(
        self, config: TinyMLAConfig, tp_group: TPGroup, seed: int, device: torch.device
    ) -> None:
        tp_size = tp_group.tp_size
        if config.num_heads % tp_size or config.intermediate_size % tp_size:
            raise ValueError(
                f"{config.name} cannot be split over tp_size={tp_size}: num_heads="
                f"{config.num_heads}, intermediate_size={config.intermediate_size}"
            )
        self.config = config
        self.tp_group = tp_group
        self.vocab_size = config.vocab_size
        self.heads_per_rank = config.num_heads // tp_size
        gen = torch.Generator().manual_seed(seed)
        dim = config.hidden_size
        embed = torch.randn((config.vocab_size, dim), generator=gen, dtype=torch.float64)
        self.embed = quantize(embed).to(device)  # [V, D]
        self.layers = [self._layer(gen, device) for _ in range(config.num_layers)]
        self.final_norm = _norm_gain(gen, dim).to(device)  # [D]
        self.lm_head = _weight(gen, (dim, config.vocab_size), dim**-0.5).to(device)  # [D, V]
        self.cos, self.sin = rotary_tables(
            config.max_model_len, config.rotary_dim, config.rope_base, device
        )  # each [max_model_len, rotary_dim / 2]
        self.exp_table = exp_table(device)

    def check_invariants(self) -> None:
        cfg, num_heads = self.config, self.heads_per_rank
        for idx, layer in enumerate(self.layers):
            expected = {
                "wq": (cfg.hidden_size, num_heads * cfg.head_dim),
                "w_kv_down": (cfg.hidden_size, cfg.compressed_kv_dim),
                "w_k_up": (cfg.compressed_kv_dim, num_heads * cfg.content_dim),
                "w_v_up": (cfg.compressed_kv_dim, num_heads * cfg.head_dim),
                "wo": (num_heads * cfg.head_dim, cfg.hidden_size),
            }
            for name, shape in expected.items():
                found = tuple(getattr(layer, name).shape)
                assert found == shape, f"layer {idx} {name} is {found}, expected {shape}"
            for name in MLALayerWeights.__slots__:
                weight = getattr(layer, name)
                if name.endswith("norm"):
                    weight = weight - 1.0  # gains are 1 + a weight on the grid
                on_grid = quantize(weight, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS)
                assert torch.equal(weight, on_grid), f"layer {idx} {name} is off the grid"

    def _layer(self, gen: torch.Generator, device: torch.device) -> MLALayerWeights:
        """Draw the full layer (the same on every rank), then keep this rank's heads."""
        cfg, rank, num_heads = self.config, self.tp_group.rank, self.heads_per_rank
        dim, hd, rank_dim = cfg.hidden_size, cfg.head_dim, cfg.compressed_kv_dim
        heads = _head_columns(rank, num_heads, hd)
        content = _head_columns(rank, num_heads, cfg.content_dim)
        mlp_cols = cfg.intermediate_size // self.tp_group.tp_size
        mlp = slice(rank * mlp_cols, (rank + 1) * mlp_cols)
        full = dict(
            attn_norm=_norm_gain(gen, dim),
            wq=_weight(gen, (dim, cfg.num_heads * hd), dim**-0.5)[:, heads],
            w_kv_down=_weight(gen, (dim, rank_dim), dim**-0.5),
            kv_norm=_norm_gain(gen, rank_dim),
            w_k_rotary=_weight(gen, (dim, cfg.rotary_dim), dim**-0.5),
            w_k_up=_weight(gen, (rank_dim, cfg.num_heads * cfg.content_dim), rank_dim**-0.5)[
                :, content
            ],
            w_v_up=_weight(gen, (rank_dim, cfg.num_heads * hd), rank_dim**-0.5)[:, heads],
            wo=_weight(gen, (cfg.num_heads * hd, dim), (cfg.num_heads * hd) ** -0.5)[heads],
            mlp_norm=_norm_gain(gen, dim),
            w_gate=_weight(gen, (dim, cfg.intermediate_size), dim**-0.5)[:, mlp],
            w_up=_weight(gen, (dim, cfg.intermediate_size), dim**-0.5)[:, mlp],
            w_down=_weight(gen, (cfg.intermediate_size, dim), cfg.intermediate_size**-0.5)[mlp],
        )
        return MLALayerWeights(**{k: v.contiguous().to(device) for k, v in full.items()})

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """Logits [S, V] (float64) of the tokens `logits_idx`, reading the paged latent caches."""
        if not isinstance(kv, PagedKV):
            raise TypeError(f"{self.config.name} pages its latents through a PagedKV, got {kv!r}")
        return self.forward_latent(token_ids, positions, logits_idx, PagedLatentKV(kv))

    def forward_latent(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        latents: LatentContext,
    ) -> torch.Tensor:
        """Logits [S, V] (float64) of the tokens `logits_idx` after writing every token's latent.

        Args:
            token_ids, positions: [T] int64, the step's flattened tokens.
            logits_idx: [S] indices into T of the tokens to produce logits for.
        """
        x = self.embed[token_ids]  # [T, D]
        cos, sin = self.cos[positions], self.sin[positions]
        last = len(self.layers) - 1
        for layer_idx, layer in enumerate(self.layers):
            attn = self._attention(layer_idx, layer, x, cos, sin, latents, layer_idx == last)
            if layer_idx == last:  # only the sampled tokens matter past the last latent write
                x, attn = x[logits_idx], attn[logits_idx]
            x = quantize(x + self.tp_group.all_reduce(attn @ layer.wo))
            x = quantize(x + self.tp_group.all_reduce(self._mlp(layer, x)))
        if not self.layers:
            x = x[logits_idx]
        return quantize(rms_norm(x, self.final_norm) @ self.lm_head)

    def _attention(
        self,
        layer_idx: int,
        layer: MLALayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        latents: LatentContext,
        logits_only: bool,
    ) -> torch.Tensor:
        """This rank's heads: write every token's latent, then attend; returns [T, H_r * hd]."""
        cfg, num_tokens = self.config, x.shape[0]
        h = rms_norm(x, layer.attn_norm)
        q = quantize(h @ layer.wq).view(num_tokens, self.heads_per_rank, cfg.head_dim)
        q_rotary = rotate(q[..., cfg.content_dim :], cos, sin)
        q = torch.cat((q[..., : cfg.content_dim], q_rotary), dim=-1)  # [T, H_r, head_dim]
        compressed = rms_norm(quantize(h @ layer.w_kv_down), layer.kv_norm)  # [T, compressed]
        k_rotary = rotate(quantize(h @ layer.w_k_rotary)[:, None, :], cos, sin)  # [T, 1, rotary]
        name = cfg.layer_name(layer_idx)
        # before any read: a same-step neighbour may share these blocks
        latents.write_latent(name, torch.cat((compressed, k_rotary[:, 0]), dim=-1))
        if isinstance(latents, PagedLatentKV) and latents.paged.num_cascade_tokens(name):
            return self._cascade_attention(layer, name, q, latents, logits_only)
        out = x.new_zeros((num_tokens, self.heads_per_rank * cfg.head_dim))  # [T, H_r * hd]
        for chunk in latents.chunks(name, logits_only):
            k_ctx, v_ctx = self._up_project(layer, latents.gather_latent(name, chunk).double())
            result = attend(
                q[chunk.query_idx], k_ctx, v_ctx, chunk.mask, self.exp_table
            )  # [S, n, H_r * head_dim]
            out[chunk.query_idx.reshape(-1)] = result.reshape(-1, out.shape[1])
        return out

    def _cascade_attention(
        self,
        layer: MLALayerWeights,
        name: str,
        q: torch.Tensor,
        latents: PagedLatentKV,
        logits_only: bool,
    ) -> torch.Tensor:
        """Attention over a prefix all the step's requests share: its latents are gathered and
        up-projected once, not once per request (worker/cascade.py); returns [T, H_r * hd]."""
        paged = latents.paged
        prefix = paged.kv_caches[name][prefix_block_ids(paged, name)]  # [N, block_size, latent]
        latent = prefix.reshape(1, -1, prefix.shape[-1]).double()  # [1, P, latent_dim]
        k_prefix, v_prefix = self._up_project(layer, latent)  # each [1, P, H_r, head_dim]

        def gather(chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
            return self._up_project(layer, latents.gather_latent(name, chunk).double())

        chunks = paged.suffix_chunks(name, logits_only)
        return attend_with_shared_prefix(
            chunks, q, k_prefix[0], v_prefix[0], gather, self.exp_table
        )

    def _up_project(
        self, layer: MLALayerWeights, latent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [S, L, H_r, head_dim] of this rank's heads from latents [S, L, *]."""
        cfg = self.config
        num_seqs, num_ctx = latent.shape[:2]
        compressed = latent[..., : cfg.compressed_kv_dim]  # [S, L, compressed_kv_dim]
        k_rotary = latent[..., None, cfg.compressed_kv_dim :]  # [S, L, 1, rotary_dim]
        shape = (num_seqs, num_ctx, self.heads_per_rank)
        k_content = quantize(compressed @ layer.w_k_up).view(*shape, cfg.content_dim)
        k = torch.cat((k_content, k_rotary.expand(*shape, cfg.rotary_dim)), dim=-1)
        v = quantize(compressed @ layer.w_v_up).view(*shape, cfg.head_dim)
        return k, v

    def _mlp(self, layer: MLALayerWeights, x: torch.Tensor) -> torch.Tensor:
        """This rank's MLP columns; returns its exact partial sum [T, D] before the all-reduce."""
        h = rms_norm(x, layer.mlp_norm)
        gate = quantize(h @ layer.w_gate)
        up = quantize(h @ layer.w_up)
        return quantize(torch.relu(gate) * up) @ layer.w_down
