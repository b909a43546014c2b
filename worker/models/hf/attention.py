"""Attention of a checkpoint's layer over the paged KV cache: the one seam where a paged kernel
(FlashAttention, FlashInfer) can replace the gather below.

Today each context chunk's K/V are gathered through the block table (PagedKV.gather) and
attended with torch's scaled_dot_product_attention under the chunk's mask, on CPU and CUDA.
Whole contexts are read (never cascade), which is correct for any schedule.
"""

import torch
import torch.nn.functional as F

from worker.attention import KVContext


def paged_attention(
    kv: KVContext, layer_name: str, q: torch.Tensor, scale: float, logits_only: bool
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
    for chunk in kv.chunks(layer_name, logits_only):
        k_ctx, v_ctx = kv.gather(layer_name, chunk)  # each [S, L, KV_r, head_dim]
        queries = q[chunk.query_idx].transpose(1, 2)  # [S, H_r, n, head_dim]
        result = F.scaled_dot_product_attention(
            queries,
            k_ctx.to(q.dtype).transpose(1, 2),  # [S, KV_r, L, head_dim]
            v_ctx.to(q.dtype).transpose(1, 2),
            attn_mask=chunk.mask[:, None],  # [S, 1, n, L]: True where the query reads the entry
            scale=scale,
            enable_gqa=True,  # H_r query heads share KV_r heads in order, as transformers' GQA
        )  # [S, H_r, n, head_dim]
        rows = result.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [S * n, H_r * hd]
        out[chunk.query_idx.reshape(-1)] = rows
    return out
