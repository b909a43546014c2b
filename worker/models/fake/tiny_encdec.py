"""tiny-encdec: a small encoder-decoder over the paged KV cache, in tiny-llama's exact fixed point.

The encoder (bidirectional attention and an MLP over the request's encoder tokens, dense, no
cache) runs whole on every rank when a request is first scheduled or resumed; each decoder layer
projects its output to cross-attention K/V for this rank's heads, stored in the cross-attention
group's blocks. Decoder layers are tiny-llama's (self-attention, MLP) with a cross-attention
between them that reads the encoder K/V only through the block table.
"""

from dataclasses import dataclass, field

import torch

from protocol.kv_cache_spec import CrossAttentionSpec, KVCacheGroupSpec
from worker.cross_attention import CrossKVContext
from worker.distributed import TPGroup
from worker.models.fake.tiny_llama import LayerWeights, TinyLlama, TinyLlamaConfig
from worker.numerics.fixed_point import (
    WEIGHT_FRAC_BITS,
    WEIGHT_INT_BITS,
    attend,
    quantize,
    rms_norm,
    rotate,
)

ENCODER_SEED_OFFSET = 1_000_003  # the encoder and cross weights draw from their own generator


@dataclass(frozen=True, slots=True)
class TinyEncDecConfig:
    name: str
    decoder: TinyLlamaConfig = field(default_factory=lambda: TinyLlamaConfig("decoder"))
    num_encoder_layers: int = 1
    max_num_encoder_tokens: int = 64  # the longest encoder input a request may bring

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.decoder.eos_token_id

    @property
    def max_model_len(self) -> int:
        return self.decoder.max_model_len

    def cross_layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.cross_attn"

    def kv_cache_groups(self, block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
        """The decoder's self-attention group, then one cross-attention group of every layer."""
        decoder = self.decoder
        spec = CrossAttentionSpec(
            block_size=block_size,
            num_kv_heads=decoder.num_kv_heads,
            head_dim=decoder.head_dim,
            dtype=dtype,
            max_num_encoder_tokens=self.max_num_encoder_tokens,
        )
        names = [self.cross_layer_name(i) for i in range(decoder.num_layers)]
        return [*decoder.kv_cache_groups(block_size, dtype), KVCacheGroupSpec(names, spec)]


TINY_ENCDEC = TinyEncDecConfig(
    "tiny-encdec", decoder=TinyLlamaConfig("tiny-encdec", num_layers=2, max_model_len=1024)
)


@dataclass(slots=True)
class CrossWeights:
    """One decoder layer's cross-attention on this rank (its heads), float64 on the grid."""

    norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, heads_per_rank * head_dim]
    wk: torch.Tensor  # [D, kv_heads_per_rank * head_dim], applied to the encoder output
    wv: torch.Tensor  # [D, kv_heads_per_rank * head_dim]
    wo: torch.Tensor  # [heads_per_rank * head_dim, D]


def _weight(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * std
    return quantize(values, WEIGHT_FRAC_BITS, WEIGHT_INT_BITS)


def _norm_gain(gen: torch.Generator, size: int) -> torch.Tensor:
    return _weight(gen, (size,), 0.1) + 1.0


class TinyEncDec(TinyLlama):
    """The encoder-decoder on one TP rank. Token rule: greedy or sampled from exact fixed-point
    logits, where each decoder token also attends to every token of its request's encoder.

    Invariants, beside tiny-llama's: the encoder's weights are whole and equal on every rank; the
    rank's cross-attention heads are the same slice as its self-attention heads.
    """

    def __init__(
        self, config: TinyEncDecConfig, tp_group: TPGroup, seed: int, device: torch.device
    ) -> None:
        super().__init__(config.decoder, tp_group, seed, device)
        self.encdec_config = config
        gen = torch.Generator().manual_seed(seed + ENCODER_SEED_OFFSET)
        self.encoder_layers = [
            self._encoder_layer(gen, device) for _ in range(config.num_encoder_layers)
        ]
        self.encoder_norm = _norm_gain(gen, config.decoder.hidden_size).to(device)  # [D]
        self.cross_layers = [
            self._cross_layer(gen, device) for _ in range(config.decoder.num_layers)
        ]

    def _encoder_layer(self, gen: torch.Generator, device: torch.device) -> LayerWeights:
        """All heads and MLP columns: the encoder runs whole on every rank."""
        cfg = self.config
        dim, hd, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        full = dict(
            attn_norm=_norm_gain(gen, dim),
            wq=_weight(gen, (dim, cfg.num_heads * hd), dim**-0.5),
            wk=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5),
            wv=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5),
            wo=_weight(gen, (cfg.num_heads * hd, dim), (cfg.num_heads * hd) ** -0.5),
            mlp_norm=_norm_gain(gen, dim),
            w_gate=_weight(gen, (dim, inner), dim**-0.5),
            w_up=_weight(gen, (dim, inner), dim**-0.5),
            w_down=_weight(gen, (inner, dim), inner**-0.5),
        )
        return LayerWeights(**{k: v.contiguous().to(device) for k, v in full.items()})

    def _cross_layer(self, gen: torch.Generator, device: torch.device) -> CrossWeights:
        """Draw the whole layer (the same on every rank), then keep this rank's heads."""
        cfg, rank = self.config, self.tp_group.rank
        dim, hd = cfg.hidden_size, cfg.head_dim
        q_cols = slice(rank * self.heads_per_rank * hd, (rank + 1) * self.heads_per_rank * hd)
        kv_cols = slice(
            rank * self.kv_heads_per_rank * hd, (rank + 1) * self.kv_heads_per_rank * hd
        )
        full = dict(
            norm=_norm_gain(gen, dim),
            wq=_weight(gen, (dim, cfg.num_heads * hd), dim**-0.5)[:, q_cols],
            wk=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5)[:, kv_cols],
            wv=_weight(gen, (dim, cfg.num_kv_heads * hd), dim**-0.5)[:, kv_cols],
            wo=_weight(gen, (cfg.num_heads * hd, dim), (cfg.num_heads * hd) ** -0.5)[q_cols],
        )
        return CrossWeights(**{k: v.contiguous().to(device) for k, v in full.items()})

    def forward(  # type: ignore[override]
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: CrossKVContext,
    ) -> torch.Tensor:
        """Logits [S, V] of the tokens `logits_idx`, after encoding the step's new encoder inputs
        into the cross-attention blocks and writing every token's self-attention K/V."""
        for req_idx, encoder_token_ids in kv.encoder_requests():
            self._encode(req_idx, encoder_token_ids, kv)
        x = self.embed[token_ids]  # [T, D]
        cos, sin = self.cos[positions], self.sin[positions]
        token_reqs = kv.token_requests()  # [T]
        last = len(self.layers) - 1
        for layer_idx, layer in enumerate(self.layers):
            attn = self._attention(layer_idx, layer, x, cos, sin, kv, layer_idx == last)
            if layer_idx == last:  # only the sampled tokens matter past the last K/V write
                x, attn, token_reqs = x[logits_idx], attn[logits_idx], token_reqs[logits_idx]
            x = quantize(x + self.tp_group.all_reduce(attn @ layer.wo))
            cross = self.cross_layers[layer_idx]
            attn = self._cross_attention(layer_idx, cross, x, token_reqs, kv)
            x = quantize(x + self.tp_group.all_reduce(attn @ cross.wo))
            x = quantize(x + self.tp_group.all_reduce(self._mlp(layer, x)))
        return quantize(rms_norm(x, self.final_norm) @ self.lm_head)

    def _encode(self, req_idx: int, encoder_token_ids: torch.Tensor, kv: CrossKVContext) -> None:
        """Run the encoder over one request's input and store every layer's cross K/V."""
        cfg = self.config
        num_tokens, hd = len(encoder_token_ids), cfg.head_dim
        x = self.embed[encoder_token_ids]  # [E, D]
        cos, sin = self.cos[:num_tokens], self.sin[:num_tokens]
        everything = torch.ones((1, num_tokens, num_tokens), dtype=torch.bool, device=x.device)
        for layer in self.encoder_layers:
            h = rms_norm(x, layer.attn_norm)
            q = rotate(quantize(h @ layer.wq).view(num_tokens, cfg.num_heads, hd), cos, sin)
            k = rotate(quantize(h @ layer.wk).view(num_tokens, cfg.num_kv_heads, hd), cos, sin)
            v = quantize(h @ layer.wv).view(num_tokens, cfg.num_kv_heads, hd)
            attn = attend(q[None], k[None], v[None], everything, self.exp_table)[0]  # [E, H*hd]
            x = quantize(x + attn @ layer.wo)
            x = quantize(x + self._mlp(layer, x))
        out = rms_norm(x, self.encoder_norm)  # [E, D]
        for layer_idx, cross in enumerate(self.cross_layers):
            k = quantize(out @ cross.wk).view(num_tokens, self.kv_heads_per_rank, hd)
            v = quantize(out @ cross.wv).view(num_tokens, self.kv_heads_per_rank, hd)
            kv.write_cross(self.encdec_config.cross_layer_name(layer_idx), req_idx, k, v)

    def _cross_attention(
        self,
        layer_idx: int,
        cross: CrossWeights,
        x: torch.Tensor,
        token_reqs: torch.Tensor,
        kv: CrossKVContext,
    ) -> torch.Tensor:
        """This rank's heads of each token over its request's whole encoder; [T, H_r * hd]."""
        num_tokens, hd = x.shape[0], self.config.head_dim
        q = quantize(rms_norm(x, cross.norm) @ cross.wq).view(num_tokens, self.heads_per_rank, hd)
        name = self.encdec_config.cross_layer_name(layer_idx)
        out = x.new_zeros((num_tokens, self.heads_per_rank * hd))  # [T, H_r * head_dim]
        for req_idx in torch.unique(token_reqs).tolist():
            idx = torch.nonzero(token_reqs == req_idx)[:, 0]
            k, v = kv.gather_cross(name, req_idx)  # [E, G_r, head_dim]
            mask = torch.ones((1, len(idx), k.shape[0]), dtype=torch.bool, device=x.device)
            result = attend(q[idx][None], k.double()[None], v.double()[None], mask, self.exp_table)
            out[idx] = result[0]
        return out
