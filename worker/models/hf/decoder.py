"""HFDecoder: a Llama-family checkpoint (Llama, Qwen2, Qwen3, Mistral, Phi-3, and the mixtures of
experts Qwen3-MoE and Mixtral) or a Gemma 2/3 one on one TP rank, over the paged KV cache:
RMSNorm, rotary, grouped-query attention, gated MLP or routed gated experts (moe.py).

Gemma differs in its layer (`_gemma_forward`): (1 + weight) RMSNorms around both sublayers
(sandwich norms), embeddings scaled by sqrt(D) in the compute dtype, GeGLU (tanh), its own
attention scale and soft-capping, and (Gemma 3) a rope per layer type. Phi-3 is a Llama layer
whose merged q/k/v and gate/up come from fused tensors (weights.py) and whose rotary may be partial.

q/k/v and gate/up are column-parallel (this rank's heads and MLP rows, each pair merged into one
GEMM); o and down are row-parallel with one all-reduce each, their biases added once after it.
A sparse layer's experts split the same way (each rank holds its columns of every expert), their
weighted sum all-reduced once. Norms and rotary run in float32 and cast back, as transformers
does, so logits match it in float32 and stay close in bf16. The steps between GEMMs go through
LayerOps (layer_ops.py): torch's ops on the CPU, fused Triton kernels on CUDA. Attention goes
through the step's attention backend (worker/attention_backends/).
"""

import torch
import torch.nn.functional as F

from worker.attention import KVContext, PagedKV
from worker.attention_backends.backend import AttentionBackend, StepAttention
from worker.attention_backends.reference import ReferenceAttention
from worker.distributed import TPGroup
from worker.models.hf.config import HFConfig
from worker.models.hf.fp8_linear import FP8_DTYPE
from worker.models.hf.kv_groups import layer_name
from worker.models.hf.layer_ops import LayerOps, TorchLayerOps, gemma_rms_norm, layer_ops_for
from worker.models.hf.linear import linear
from worker.models.hf.rope import Rotary
from worker.models.hf.weights import LayerWeights, RankShard, load_rank_weights
from worker.step_buffers import DeviceStep

# On the CPU a half-precision partial sum is all-reduced in float32: the shared-memory
# all-reduce takes float32, and the rounding then happens once, after the sum.
HALF_DTYPES = (torch.bfloat16, torch.float16)


class HFDecoder:
    """One rank's shard of a checkpoint. Token rule: whatever the checkpoint's logits say.

    Invariants: the rank owns query heads [rank * H_r, (rank + 1) * H_r), the KV heads those read
    (RankShard), and MLP rows [rank * I_r, (rank + 1) * I_r); embeddings, norms and lm_head are
    whole. Every rank's logits are the same bytes: each all-reduce leaves identical sums.
    """

    def __init__(
        self,
        config: HFConfig,
        tp_group: TPGroup,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: AttentionBackend = ReferenceAttention,
        layer_ops: LayerOps | None = None,  # None: the device's (layer_ops_for)
        max_model_len: int | None = None,  # the engine's; None: max_position_embeddings
    ) -> None:
        self.config = config
        self.attention_backend = attention_backend
        self.layer_ops = layer_ops_for(device) if layer_ops is None else layer_ops
        self.tp_group = tp_group
        self.device = device
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.shard = RankShard.of(config, tp_group.rank, tp_group.tp_size)
        self.weights = load_rank_weights(config, self.shard, device, dtype)
        # longrope picks its factor set by the longest sequence served (rope.Rotary)
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.rotary = Rotary(config.rope, config.head_dim, device, self.max_model_len)
        # Gemma 3's sliding layers rotate with their own rope (a local theta, unscaled)
        self.sliding_rotary = (
            None
            if config.sliding_rope is None
            else Rotary(config.sliding_rope, config.head_dim, device)
        )
        self.scale = (
            config.head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        )
        if config.gemma_norms or self.rotary.rotary_dim < config.head_dim:
            # Gemma's norms and a partial rotary run as torch's ops (the fused kernels norm as
            # Llama does and rotate whole heads)
            self.layer_ops = TorchLayerOps()

    def weights_bytes(self) -> int:
        return self.weights.num_bytes()

    def check_invariants(self) -> None:
        """Every layer holds exactly this rank's shard, in the compute dtype (or, kept in fp8,
        float8 weights with float32 scales), on the device."""
        cfg, shard, hd = self.config, self.shard, self.config.head_dim
        dtypes = {self.dtype}
        if cfg.quantization is not None:
            dtypes |= {FP8_DTYPE, torch.float32}
        q_rows, kv_rows = shard.num_heads_per_rank * hd, shard.num_kv_heads_per_rank * hd
        for idx, layer in enumerate(self.weights.layers):
            shapes = {
                "qkv_proj": (layer.qkv_proj.shape, (q_rows + 2 * kv_rows, cfg.hidden_size)),
                "o_proj": (layer.o_proj.shape, (cfg.hidden_size, q_rows)),
                **self._mlp_shapes(layer),
            }
            for name, (shape, expected) in shapes.items():
                assert tuple(shape) == expected, (
                    f"layer {idx} {name} is {tuple(shape)}, not {expected}"
                )
            for tensor in layer.tensors():
                assert tensor.dtype in dtypes and tensor.device.type == self.device.type, (
                    f"layer {idx} holds a {tensor.dtype} tensor on {tensor.device}, expected "
                    f"{sorted(map(str, dtypes))} on {self.device}"
                )

    def _mlp_shapes(self, layer: LayerWeights) -> dict[str, tuple[torch.Size, tuple[int, int]]]:
        """(shape, expected shape) of the layer's MLP weights, or of each of its experts'."""
        dim, moe = self.config.hidden_size, self.config.moe
        if layer.moe is None:
            inter = self.shard.num_intermediate_per_rank
            return {
                "gate_up_proj": (layer.gate_up_proj.shape, (2 * inter, dim)),
                "down_proj": (layer.down_proj.shape, (dim, inter)),
            }
        assert moe is not None and len(layer.moe.gate_up_proj) == moe.num_experts
        inter = self.shard.num_expert_intermediate_per_rank
        shapes = {"router": (layer.moe.router.shape, (moe.num_experts, dim))}
        for expert, (gate_up, down) in enumerate(
            zip(layer.moe.gate_up_proj, layer.moe.down_proj, strict=True)
        ):
            shapes[f"expert {expert} gate_up_proj"] = (gate_up.shape, (2 * inter, dim))
            shapes[f"expert {expert} down_proj"] = (down.shape, (dim, inter))
        return shapes

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext | DeviceStep,
    ) -> torch.Tensor:
        """Logits [S, V] (float32) of the tokens `logits_idx`, after writing every token's K/V.

        Args:
            token_ids, positions: [T] int64, the step's flattened tokens.
            logits_idx: [S] indices into T of the tokens to produce logits for.
        """
        weights, eps = self.weights, self.config.rms_norm_eps
        # a dense store (the non-paged reference model's) has no blocks: the reference reads it
        attention = (
            self.attention_backend(kv)  # a DeviceStep only reaches the Triton backend
            if isinstance(kv, (PagedKV, DeviceStep))
            else ReferenceAttention(kv)
        )
        if self.config.gemma_norms:
            return self._gemma_forward(token_ids, positions, logits_idx, attention)
        ops, layers = self.layer_ops, weights.layers
        # The residual stream: each sublayer's output is added to it as the next norm reads it,
        # which the fused kernels do in one pass, in place.
        residual = F.embedding(token_ids, weights.embed_tokens)  # [T, D]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # each [T, head_dim]
        h = ops.rms_norm(residual, layers[0].input_norm, eps)
        last = len(layers) - 1
        for idx, layer in enumerate(layers):
            attn = self._attention(idx, layer, h, cos, sin, attention, idx == last)
            if idx == last:  # past the last K/V write only the sampled tokens matter
                residual, attn = residual[logits_idx], attn[logits_idx]
            out = self._row_parallel(attn, layer.o_proj, layer.o_bias)
            h, residual = ops.add_rms_norm(out, residual, layer.post_attention_norm, eps)
            if layer.moe is not None:
                out = self._all_reduce(ops.moe(h, layer.moe))
            else:
                gate_up = linear(h, layer.gate_up_proj, layer.gate_up_bias)  # [T, 2 * I_r]
                out = ops.silu_and_mul(gate_up)
                out = self._row_parallel(out, layer.down_proj, layer.down_bias)
            next_norm = weights.final_norm if idx == last else layers[idx + 1].input_norm
            h, residual = ops.add_rms_norm(out, residual, next_norm, eps)
        return linear(h, weights.lm_head).to(torch.float32)

    def _gemma_forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        attention: StepAttention,
    ) -> torch.Tensor:
        """Gemma 2/3: each sublayer's input and output normed, then added to the residual."""
        cfg, layers, eps = self.config, self.weights.layers, self.config.rms_norm_eps
        embed = self.weights.embed_tokens
        # sqrt(D) as a float32, then rounded to the compute dtype, as transformers scales them
        normalizer = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(embed.dtype)
        normalizer = normalizer.to(embed.device)
        residual = F.embedding(token_ids, embed) * normalizer  # [T, D]
        cos_sin = self.rotary.cos_sin(positions, self.dtype)
        sliding_cos_sin = (
            cos_sin
            if self.sliding_rotary is None
            else self.sliding_rotary.cos_sin(positions, self.dtype)
        )
        last = len(layers) - 1
        for idx, layer in enumerate(layers):
            is_sliding = cfg.sliding_windows[idx] is not None
            cos, sin = sliding_cos_sin if is_sliding else cos_sin
            h = gemma_rms_norm(residual, layer.input_norm, eps)
            attn = self._attention(idx, layer, h, cos, sin, attention, idx == last)
            if idx == last:  # past the last K/V write only the sampled tokens matter
                residual, attn = residual[logits_idx], attn[logits_idx]
            out = self._row_parallel(attn, layer.o_proj, layer.o_bias)
            residual = residual + gemma_rms_norm(out, layer.post_attention_norm, eps)
            h = gemma_rms_norm(residual, layer.pre_feedforward_norm, eps)
            gate, up = linear(h, layer.gate_up_proj).chunk(2, dim=-1)  # each [T, I_r]
            out = self._row_parallel(F.gelu(gate, approximate="tanh") * up, layer.down_proj, None)
            residual = residual + gemma_rms_norm(out, layer.post_feedforward_norm, eps)
        logits = linear(
            gemma_rms_norm(residual, self.weights.final_norm, eps), self.weights.lm_head
        )
        if cfg.final_softcap is not None:  # in the compute dtype, as transformers caps them
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.to(torch.float32)

    def _attention(
        self,
        idx: int,
        layer: LayerWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: StepAttention,
        logits_only: bool,
    ) -> torch.Tensor:
        """This rank's heads of the normed h [T, D]: write K/V of every token, then attend;
        [T, H_r * head_dim]."""
        num_tokens, hd, eps = h.shape[0], self.config.head_dim, self.config.rms_norm_eps
        num_heads, num_kv_heads = self.shard.num_heads_per_rank, self.shard.num_kv_heads_per_rank
        qkv = linear(h, layer.qkv_proj, layer.qkv_bias)  # [T, (H_r + 2 * KV_r) * head_dim]
        q, k, v = qkv.split([num_heads * hd, num_kv_heads * hd, num_kv_heads * hd], dim=-1)
        q = q.view(num_tokens, num_heads, hd)
        k, v = k.view(num_tokens, num_kv_heads, hd), v.view(num_tokens, num_kv_heads, hd)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        if self.config.gemma_norms and q_norm is not None and k_norm is not None:
            # Gemma 3 norms each head its own (1 + weight) way before rotary
            q, k = gemma_rms_norm(q, q_norm, eps), gemma_rms_norm(k, k_norm, eps)
            q_norm = k_norm = None
        # Qwen3 norms each head before rotary (q_norm and k_norm); the others only rotate
        q, k = self.layer_ops.norm_and_rotate(q, k, q_norm, k_norm, eps, cos, sin)
        name = layer_name(idx)
        attention.write(name, k, v)  # before any read: a same-step neighbour may share blocks
        return attention.attend(name, q, self.scale, logits_only, self.config.attn_softcap)

    def _row_parallel(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [T, in_r] @ this rank's input columns, summed over the ranks, plus the bias once."""
        out = self._all_reduce(linear(x, weight))  # [T, D]
        return out if bias is None else out + bias

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's partial [T, D] (itself at TP 1)."""
        if self.tp_group.tp_size == 1:
            return partial
        if partial.dtype in HALF_DTYPES and partial.device.type == "cpu":
            return self.tp_group.all_reduce(partial.to(torch.float32)).to(partial.dtype)
        return self.tp_group.all_reduce(partial)
