"""Cascade attention: a prefix that every request of a step shares is read once per layer.

`plan_cascade` checks the engine's counts (SchedulerOutput.num_common_prefix_blocks) against the
step's tables; `attend_with_shared_prefix` scores every query against the prefix's K/V, gathered
(and for MLA up-projected) once, in one product, and merges each request's suffix exactly.
"""

import math
from collections.abc import Callable

import numpy as np
import torch

from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    FullAttentionSpec,
    KVCacheConfig,
    MLAAttentionSpec,
)
from worker.attention import ContextChunk, PagedKV, StepLayout
from worker.block_table import MultiGroupBlockTable
from worker.numerics.fixed_point import (
    grouped_values,
    masked_scores,
    quantize,
    table_weights,
    ungroup,
)

# Queries x prefix tokens scored in one product: the step's prefix scores are held at once
# ([heads, queries, prefix] float64), so a step past this (a long prefill) reads per request.
CASCADE_SCORE_BUDGET = 1 << 18


def plan_cascade(
    num_common_prefix_blocks: list[int],
    kv_cache_config: KVCacheConfig,
    tables: MultiGroupBlockTable,
    layout: StepLayout,
    is_enabled: bool,
) -> list[int]:
    """Per group, the prefix tokens the step's queries read through cascade attention (0: none).

    Raises ValueError when the engine's counts do not fit the tables: another group count, a
    request whose table is shorter, or a block that differs between two scheduled requests.
    The prefix stops before every scheduled query, so no query reads it masked, and before
    any token this step writes:

    ```
    row A: | shared blocks, read once | A's own computed tokens | A's queries |
    row B: | shared blocks, read once | B's queries |
           0                   prefix_len <= min first query position, a block multiple
    ```
    """
    specs = [group.spec for group in kv_cache_config.kv_cache_groups]
    num_tokens = [0] * len(specs)
    if not num_common_prefix_blocks:
        return num_tokens
    if len(num_common_prefix_blocks) != len(specs):
        raise ValueError(
            f"num_common_prefix_blocks names {len(num_common_prefix_blocks)} groups, "
            f"the model has {len(specs)}"
        )
    rows = layout.rows
    num_queries = int(layout.num_queries.sum())
    first_query = int(layout.first_positions.min()) if len(rows) else 0
    for group_idx, num_blocks in enumerate(num_common_prefix_blocks):
        if num_blocks == 0:
            continue
        table = tables[group_idx]
        _check_shared(group_idx, num_blocks, table.block_table, table.num_blocks_per_row, rows)
        block_size = table.block_size
        prefix_len = min(num_blocks * block_size, first_query) // block_size * block_size
        if (
            is_enabled
            and type(specs[group_idx]) in (FullAttentionSpec, MLAAttentionSpec)  # plain causal
            and len(rows) >= 2  # one request alone shares nothing
            and num_queries * prefix_len <= CASCADE_SCORE_BUDGET
        ):
            num_tokens[group_idx] = prefix_len
    return num_tokens


def _check_shared(
    group_idx: int,
    num_blocks: int,
    block_table: np.ndarray,
    num_blocks_per_row: np.ndarray,
    rows: np.ndarray,
) -> None:
    """Every scheduled row holds the same `num_blocks` leading blocks, none of them null."""
    short = rows[num_blocks_per_row[rows] < num_blocks]
    if len(short):
        raise ValueError(
            f"group {group_idx} reports {num_blocks} common prefix blocks, but the request in "
            f"row {int(short[0])} holds {int(num_blocks_per_row[short[0]])}"
        )
    prefix = block_table[rows, :num_blocks]  # [R, num_blocks]
    differs = prefix != prefix[:1]
    if differs.any():
        req, block_idx = np.argwhere(differs)[0]
        raise ValueError(
            f"group {group_idx} reports {num_blocks} common prefix blocks, but block {block_idx} "
            f"is {prefix[req, block_idx]} in row {rows[req]} and {prefix[0, block_idx]} in row "
            f"{rows[0]}"
        )
    if len(rows) and (prefix[0] == NULL_BLOCK_ID).any():
        raise ValueError(
            f"group {group_idx} reports {num_blocks} common prefix blocks, but they include "
            f"the null block"
        )


def cascade_attention(
    kv: PagedKV, layer_name: str, q: torch.Tensor, logits_only: bool, table: torch.Tensor
) -> torch.Tensor:
    """Attention of the step's queries q [T, H, head_dim] as `attend` computes it, reading the
    group's shared prefix once; returns [T, H * head_dim] (only sampled rows if `logits_only`).
    """
    cache = kv.kv_caches[layer_name]  # [num_blocks, 2, block_size, G, head_dim]
    prefix = cache[prefix_block_ids(kv, layer_name)].double()  # [N, 2, block_size, G, head_dim]
    k_prefix = prefix[:, 0].reshape(-1, *prefix.shape[3:])  # [P, G, head_dim]
    v_prefix = prefix[:, 1].reshape(-1, *prefix.shape[3:])

    def gather(chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        k_ctx, v_ctx = kv.gather(layer_name, chunk)
        return k_ctx.double(), v_ctx.double()

    chunks = kv.suffix_chunks(layer_name, logits_only)
    return attend_with_shared_prefix(chunks, q, k_prefix, v_prefix, gather, table)


def prefix_block_ids(kv: PagedKV, layer_name: str) -> torch.Tensor:
    """The ids [N] of the blocks that hold the group's shared prefix, on the cache's device."""
    group_idx = kv.layer_to_group[layer_name]
    table = kv.tables[group_idx]
    num_blocks = kv.cascade_tokens[group_idx] // table.block_size
    block_ids = table.block_table[kv.layout.rows[0], :num_blocks].astype(np.int64)
    return torch.from_numpy(block_ids).to(kv.device)


def attend_with_shared_prefix(
    chunks: list[ContextChunk],
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    gather: Callable[[ContextChunk], tuple[torch.Tensor, torch.Tensor]],
    table: torch.Tensor,
) -> torch.Tensor:
    """`attend` for every query of `chunks` over the shared prefix, then its own suffix chunk.

    Args:
        q: [T, H, head_dim] the step's queries; k_prefix, v_prefix: [P, G, head_dim] float64.
        gather: a suffix chunk's float64 K and V [S, L, G, head_dim].
    Returns [T, H * head_dim]; rows no chunk names stay zero.
    """
    out = q.new_zeros((q.shape[0], q.shape[1] * q.shape[2]))  # [T, H * head_dim]
    if not chunks:
        return out
    query_idx = torch.cat([chunk.query_idx.reshape(-1) for chunk in chunks])  # [Q]
    prefix_scores = _prefix_scores(q[query_idx], k_prefix)  # [G, H/G, Q, P]: one product
    start = 0
    for chunk in chunks:
        num_seqs, num_queries = chunk.query_idx.shape
        end = start + num_seqs * num_queries
        scores = prefix_scores[:, :, start:end]
        scores = scores.reshape(*scores.shape[:2], num_seqs, num_queries, scores.shape[-1])
        k_ctx, v_ctx = gather(chunk)
        result = _attend_after_prefix(
            q[chunk.query_idx],
            k_ctx,
            v_ctx,
            chunk.mask,
            scores.permute(2, 0, 1, 3, 4),  # [S, G, H/G, n, P]
            v_prefix,
            table,
        )  # [S, n, H * head_dim]
        out[chunk.query_idx.reshape(-1)] = result.reshape(-1, out.shape[1])
        start = end
    return out


def _prefix_scores(q: torch.Tensor, k_prefix: torch.Tensor) -> torch.Tensor:
    """Scores [G, H/G, Q, P] of queries q [Q, H, head_dim] against the prefix keys, quantized
    exactly as `attend` quantizes each score."""
    num_queries, num_heads, head_dim = q.shape
    num_groups = k_prefix.shape[1]
    q = q.view(num_queries, num_groups, num_heads // num_groups, head_dim).permute(1, 2, 0, 3)
    keys = k_prefix.permute(1, 2, 0).unsqueeze(1)  # [G, 1, head_dim, P]
    return quantize((q @ keys) * (1.0 / math.sqrt(head_dim)))


def _attend_after_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    prefix_scores: torch.Tensor,
    v_prefix: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """`attend` over the prefix and then each sequence's own context, with one softmax.

    The max runs over both parts, so every weight is the table entry `attend` would look up;
    weights and weighted values are exact on the fixed-point grid, so the two partial sums add
    up to `attend`'s sums exactly and the one rounding division gives the same result.

    Args:
        q: [S, n, H, head_dim]; k, v: [S, L, G, head_dim]; mask: [S, n, L] as for `attend`.
        prefix_scores: [S, G, H/G, n, P], every entry readable; v_prefix: [P, G, head_dim].
    Returns [S, n, H * head_dim].
    """
    scores, allowed = masked_scores(q, k, mask)  # [S, G, H/G, n, L]
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), prefix_scores.amax(dim=-1, keepdim=True))
    weights = torch.where(allowed, table_weights(top - scores, table), 0.0)
    prefix_weights = table_weights(top - prefix_scores, table)  # [S, G, H/G, n, P]
    total = weights @ grouped_values(v) + _prefix_sums(prefix_weights, v_prefix)
    norm = weights.sum(dim=-1, keepdim=True) + prefix_weights.sum(dim=-1, keepdim=True)
    return ungroup(quantize(total / norm))


def _prefix_sums(prefix_weights: torch.Tensor, v_prefix: torch.Tensor) -> torch.Tensor:
    """prefix_weights [S, G, H/G, n, P] times each group's prefix values v_prefix [P, G, hd]:
    [S, G, H/G, n, hd], as one product per KV group (every row of a group shares its values,
    so they are not copied per sequence, as a broadcast product would)."""
    num_seqs, num_groups, heads_per_group, num_queries, num_prefix = prefix_weights.shape
    rows = prefix_weights.permute(1, 0, 2, 3, 4).reshape(num_groups, -1, num_prefix)
    sums = rows @ v_prefix.permute(1, 0, 2)  # [G, S * H/G * n, hd]
    sums = sums.reshape(num_groups, num_seqs, heads_per_group, num_queries, -1)
    return sums.permute(1, 0, 2, 3, 4)
