"""The reference attention backend: each context token's K/V gathered through the block table
(PagedKV.gather), then torch's scaled_dot_product_attention under the chunk's mask, on CPU and
CUDA. Every faster backend is checked against it.

Whole contexts are read (never cascade), which is correct for any schedule.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.attention import KVContext

# On CUDA torch sends a masked grouped-query call to cuDNN, which builds an execution plan for
# every new shape: 1.4 ms of CPU a call on an H200 (torch 2.11), and each step's context length
# is new, so a 28-layer decode step spent 38 ms there for 0.7 ms of GPU work. The
# memory-efficient kernel takes any mask and shape without a plan, but only equal head counts:
# the KV heads are expanded to the query heads first. MATH stays as the fallback it always is.
CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ReferenceAttention:
    """StepAttention over one step's PagedKV (or a dense store): token-by-token gathers, SDPA."""

    def __init__(self, kv: KVContext) -> None:
        self.kv = kv

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv.write(layer_name, k, v)

    def attend(
        self,
        layer_name: str,
        q: torch.Tensor,
        scale: float,
        logits_only: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(self.kv, layer_name, q, scale, logits_only, softcap)


def paged_attention(
    kv: KVContext,
    layer_name: str,
    q: torch.Tensor,
    scale: float,
    logits_only: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each query's attention over the context its layer's spec lets it read.

    Args:
        q: [T, H_r, head_dim], rotated, in the compute dtype.
        logits_only: only each sampled request's last token attends (the last layer); other
            rows of the result stay zero.
    Returns: [T, H_r * head_dim] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_zeros((num_tokens, num_heads * head_dim))  # [T, H_r * head_dim]
    expand_kv_heads = q.device.type == "cuda"
    for chunk in kv.chunks(layer_name, logits_only):
        k_ctx, v_ctx = kv.gather(layer_name, chunk)  # each [S, L, KV_r, head_dim]
        result = attend(
            q[chunk.query_idx].transpose(1, 2),  # [S, H_r, n, head_dim]
            k_ctx.to(q.dtype).transpose(1, 2),  # [S, KV_r, L, head_dim]
            v_ctx.to(q.dtype).transpose(1, 2),
            chunk.mask[:, None],  # [S, 1, n, L]: True where the query reads the entry
            scale,
            expand_kv_heads,
            softcap,
        )  # [S, H_r, n, head_dim]
        rows = result.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [S * n, H_r * hd]
        out[chunk.query_idx.reshape(-1)] = rows
    return out


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    expand_kv_heads: bool,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Masked grouped-query attention [S, H, n, head_dim]: query head h reads KV head
    h // (H / KV), in order, as transformers' GQA.

    With `expand_kv_heads` (CUDA) each KV head is repeated for its query heads and the call is
    kept off cuDNN (CUDA_BACKENDS); otherwise torch's own GQA reads the shared heads in place.
    A `softcap` (Gemma 2) takes the explicit path: SDPA has no soft-capping. `is_causal` says
    the mask is exactly query i reading entries 0..i, which SDPA then applies itself.
    """
    if softcap is not None:
        return _softcapped(queries, keys, values, mask, scale, softcap)
    attn_mask = None if is_causal else mask
    if not expand_kv_heads:
        return F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=attn_mask,
            scale=scale,
            enable_gqa=True,
            is_causal=is_causal,
        )
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [S, H, L, head_dim]
    values = values.repeat_interleave(group, dim=1)
    with sdpa_kernel(CUDA_BACKENDS):
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attn_mask, scale=scale, is_causal=is_causal
        )


def _softcapped(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap), masked) v, in float32."""
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).float()  # [S, H, L, head_dim]
    values = values.repeat_interleave(group, dim=1).float()
    scores = queries.float() @ keys.transpose(-1, -2) * scale  # [S, H, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
    return (weights @ values).to(queries.dtype)
