"""The checkpoint attention's two paths: KV heads expanded for CUDA's kernels, or read in place."""

import torch

from worker.attention_backends.reference import attend


def test_expanded_kv_heads_attend_as_grouped_query_attention() -> None:
    """Guards the CUDA path that avoids cuDNN: query head h must read KV head h // group, in
    order, and the mask must hide the same entries as torch's own grouped-query attention."""
    generator = torch.Generator().manual_seed(0)
    num_seqs, num_heads, num_kv_heads, num_queries, num_ctx, head_dim = 3, 8, 2, 4, 9, 16
    queries = torch.randn(num_seqs, num_heads, num_queries, head_dim, generator=generator)
    keys = torch.randn(num_seqs, num_kv_heads, num_ctx, head_dim, generator=generator)
    values = torch.randn(num_seqs, num_kv_heads, num_ctx, head_dim, generator=generator)
    mask = torch.rand(num_seqs, 1, num_queries, num_ctx, generator=generator) < 0.6
    mask[..., 0] = True  # every query reads at least one entry
    in_place = attend(queries, keys, values, mask, 0.25, expand_kv_heads=False)
    expanded = attend(queries, keys, values, mask, 0.25, expand_kv_heads=True)
    torch.testing.assert_close(expanded, in_place, rtol=1e-5, atol=1e-6)
    # the grouping itself: heads 0-3 read KV head 0 and heads 4-7 KV head 1
    scores = queries[:, 5] @ keys[:, 1].transpose(-1, -2) * 0.25  # [S, n, L]
    weights = torch.softmax(scores.masked_fill(~mask[:, 0], -torch.inf), dim=-1)
    by_hand = weights @ values[:, 1]
    torch.testing.assert_close(expanded[:, 5], by_hand, rtol=1e-5, atol=1e-6)
