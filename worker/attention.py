"""PagedKV: one step's view of the paged KV cache: writes new K/V, gathers each query's context.

A query reads the positions its group's spec allows (see `read_bounds`), always through the block
table. It never gathers a position outside them: the engine may already have freed those blocks.
Context indices are built once per group and step and reused by its layers.
"""

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from worker.block_table import BlockTable, MultiGroupBlockTable

# KV-cache dtypes written through their bytes: torch's CPU index_copy_ has no float8 kernel
FP8_DTYPES = (torch.float8_e4m3fn,)
GATHER_BUDGET = 1 << 15  # query x context entries per chunk; bounds the gathered K/V and scores


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each scheduled request's queries sit: request i owns tokens [offset, offset + n)."""

    rows: np.ndarray  # [R] batch row of each scheduled request
    first_positions: np.ndarray  # [R] num_computed_tokens: position of its first scheduled token
    num_queries: np.ndarray  # [R] its scheduled token count
    token_offsets: np.ndarray  # [R] index of its first token in the flattened batch
    logits_reqs: np.ndarray  # [S] the requests sampled this step (their chunk reaches the end)
    num_prompt_tokens: np.ndarray  # [R] leading tokens that came with it (R-SWA reads them all)
    # some request needs the logits of prompt tokens (prompt_logprobs): the last layer attends
    # every query row, not only the sampled ones (`logits_only` is ignored)
    has_prompt_logits: bool = False


@dataclass(frozen=True, slots=True)
class ContextChunk:
    """S query sequences of up to n queries each, with up to L context entries each."""

    query_idx: torch.Tensor  # [S, n] token index in the step of each query
    block_idx: torch.Tensor  # [S, L] block id of each context entry
    block_offsets: torch.Tensor  # [S, L] offset of each entry in its block
    positions: torch.Tensor  # [S, L] position of each entry; padding repeats a real one
    mask: torch.Tensor  # [S, n, L] True where the query may read the entry


class KVContext(Protocol):
    """What a model forward needs of a KV store: PagedKV here, a dense store in the reference."""

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]: ...

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]: ...


def read_bounds(
    spec: KVCacheSpec, positions: np.ndarray, num_prompt_tokens: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """(head_end, tail_start) of each query position p: it reads [0, head_end) and [tail_start, p].

    head_end <= tail_start, so no position is read twice. Full attention reads [0, p]; a sliding
    window the `sliding_window` tokens up to p; chunked local attention p's own chunk; R-SWA the
    prompt and the `rswa_window` tokens before p:

    ```
    R-SWA, p past the prompt:  | prompt: [0, head_end) | gap, never read | [p - rswa_window, p] |
    ```
    """
    head_end = np.zeros_like(positions)
    match spec:
        case SlidingWindowSpec():
            return head_end, np.maximum(positions - spec.sliding_window + 1, 0)
        case ChunkedLocalAttentionSpec():
            return head_end, positions // spec.attention_chunk_size * spec.attention_chunk_size
        case RSWASpec():
            tail_start = np.maximum(positions - spec.rswa_window, 0)
            # A query inside the prompt, or whose window reaches back into it, reads all of [0, p].
            return np.minimum(num_prompt_tokens, tail_start), tail_start
    return head_end, head_end


def read_mask(
    spec: KVCacheSpec,
    ctx_pos: np.ndarray,
    query_pos: np.ndarray,
    num_prompt_tokens: np.ndarray | int,
) -> np.ndarray:
    """True where a query at `query_pos` reads the entry at `ctx_pos` (broadcast together)."""
    head_end, tail_start = read_bounds(spec, query_pos, num_prompt_tokens)
    return (ctx_pos <= query_pos) & ((ctx_pos < head_end) | (ctx_pos >= tail_start))


class PagedKV:
    """The paged cache as one step's model forward sees it.

    It is built for one step and never changed: the constructor maps every scheduled token to a
    slot and refuses one that maps into the null block. The ModelRunner walks the persistent
    caches' shapes and null blocks.
    """

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        kv_cache_config: KVCacheConfig,
        tables: MultiGroupBlockTable,
        layout: StepLayout,
        device: torch.device,
        cascade_tokens: list[int] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.layout = layout
        self.tables = tables
        self.layer_to_group: dict[str, int] = {}
        self.specs: list[KVCacheSpec] = []  # what each group's queries read (`read_bounds`)
        for group_idx, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                self.layer_to_group[name] = group_idx
            self.specs.append(group.spec)
        token_rows = np.repeat(layout.rows, layout.num_queries)
        token_positions = self._token_positions()
        # A cross-attention group holds encoder K/V, never a decoder token's: PagedCrossKV
        # (worker/cross_attention.py) owns it, so decoder positions skip its table. A Mamba
        # group holds one state per block, not a slot per token: worker/mamba_state.py owns it.
        self.write_indices = [
            None
            if isinstance(spec, (CrossAttentionSpec, MambaSpec))
            else self._block_indices(table, token_rows, token_positions)
            for spec, table in zip(self.specs, tables.tables, strict=True)
        ]
        # Per group, leading tokens every query reads through cascade attention (worker/cascade.py)
        # and that `suffix_chunks` leaves out; 0 where the group reads each context whole.
        self.cascade_tokens = cascade_tokens or [0] * len(self.specs)
        self._chunks: dict[tuple[int, bool, int], list[ContextChunk]] = {}
        self._rows: dict[str, tuple[torch.Tensor, int, int]] = {}  # see token_rows
        self.build_s = 0.0  # seconds spent building context indices (batch preparation, not model)

    def _token_positions(self) -> np.ndarray:
        layout = self.layout
        starts = np.repeat(layout.first_positions - layout.token_offsets, layout.num_queries)
        return starts + np.arange(int(layout.num_queries.sum()))

    def _block_indices(
        self, table: BlockTable, rows: np.ndarray, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = table.compute_slot_mapping(rows, positions)
        block_ids = slots // table.block_size
        if (block_ids == NULL_BLOCK_ID).any():
            bad = int(np.argmax(block_ids == NULL_BLOCK_ID))
            raise ValueError(
                f"position {int(positions[bad])} of row {int(rows[bad])} maps to the null block"
            )
        return (
            torch.from_numpy(block_ids).to(self.device),
            torch.from_numpy(slots % table.block_size).to(self.device),
        )

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [T, num_kv_heads_per_rank, head_dim] of every scheduled token."""
        rows, block_rows, block_size = self.token_rows(layer_name)
        block_idx, offsets = self.write_indices[self.layer_to_group[layer_name]]
        k_rows = block_idx * block_rows + offsets
        if rows.dtype in FP8_DTYPES:  # saturated to the format's range, stored as its bytes
            limit = torch.finfo(rows.dtype).max
            k, v = (t.clamp(-limit, limit).to(rows.dtype).view(torch.uint8) for t in (k, v))
            rows = rows.view(torch.uint8)
        rows.index_copy_(0, k_rows, k.to(rows.dtype))
        rows.index_copy_(0, k_rows + block_size, v.to(rows.dtype))

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [S, L, num_kv_heads_per_rank, head_dim] of a chunk's context, in cache dtype."""
        rows, block_rows, block_size = self.token_rows(layer_name)
        shape = (*chunk.block_idx.shape, *rows.shape[1:])
        k_rows = (chunk.block_idx * block_rows + chunk.block_offsets).reshape(-1)
        return (
            rows.index_select(0, k_rows).view(shape),
            rows.index_select(0, k_rows + block_size).view(shape),
        )

    def token_rows(self, layer_name: str) -> tuple[torch.Tensor, int, int]:
        """The layer's cache [num_blocks, 2, block_size, H, D] as rows [N, H, D] of one token's K
        or V, the rows from one block to the next, and block_size (K's rows to V's).

        One-dimensional index_select and index_copy_ over these rows cost a fifth of indexing
        the five-dimensional cache with two index tensors. Block b's K of offset o is row
        b * block_rows + o and its V that row + block_size; block_rows exceeds 2 * block_size
        when the shared tensor pads this group's pages to a larger one.
        """
        if layer_name not in self._rows:
            cache = self.kv_caches[layer_name]
            num_blocks, _, block_size, heads, head_dim = cache.shape
            row_elems = heads * head_dim
            inner = (block_size * row_elems, row_elems, head_dim, 1)
            if cache.stride()[1:] != inner or cache.stride(0) % row_elems:
                raise ValueError(
                    f"layer {layer_name}'s KV cache has strides {cache.stride()}: expected "
                    f"contiguous blocks (inner strides {inner}) at a multiple of {row_elems}"
                )
            block_rows = cache.stride(0) // row_elems
            num_rows = (num_blocks - 1) * block_rows + 2 * block_size
            rows = cache.as_strided((num_rows, heads, head_dim), (row_elems, head_dim, 1))
            self._rows[layer_name] = (rows, block_rows, block_size)
        return self._rows[layer_name]

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        """Context chunks of every scheduled token, or only of each sampled request's last token."""
        return self._cached_chunks(self.layer_to_group[layer_name], logits_only, 0)

    def num_cascade_tokens(self, layer_name: str) -> int:
        """Leading tokens of every context that cascade attention reads once for the layer."""
        return self.cascade_tokens[self.layer_to_group[layer_name]]

    def suffix_chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        """As `chunks`, but each context starts after the group's cascade prefix."""
        group_idx = self.layer_to_group[layer_name]
        return self._cached_chunks(group_idx, logits_only, self.cascade_tokens[group_idx])

    def _cached_chunks(self, group_idx: int, logits_only: bool, skip: int) -> list[ContextChunk]:
        logits_only = logits_only and not self.layout.has_prompt_logits
        key = (group_idx, logits_only, skip)
        if key not in self._chunks:
            start = time.perf_counter()
            self._chunks[key] = self._build_chunks(group_idx, logits_only, skip)
            self.build_s += time.perf_counter() - start
        return self._chunks[key]

    def _build_chunks(self, group_idx: int, logits_only: bool, skip: int) -> list[ContextChunk]:
        layout, spec = self.layout, self.specs[group_idx]
        table = self.tables[group_idx]
        last_positions = layout.first_positions + layout.num_queries - 1
        if logits_only:
            reqs = layout.logits_reqs
            last_query = (
                last_positions[reqs],
                layout.token_offsets[reqs] + layout.num_queries[reqs] - 1,
            )
            return self._single_query_chunks(table, spec, reqs, *last_query, skip)
        is_single = layout.num_queries == 1
        singles = np.flatnonzero(is_single)
        first_positions, token_offsets = layout.first_positions, layout.token_offsets
        chunks = self._single_query_chunks(
            table, spec, singles, first_positions[singles], token_offsets[singles], skip
        )
        for req in np.flatnonzero(~is_single):
            chunks.extend(self._prefill_chunks(table, spec, req, skip))
        return chunks

    def _single_query_chunks(
        self,
        table: BlockTable,
        spec: KVCacheSpec,
        reqs: np.ndarray,
        positions: np.ndarray,
        token_idx: np.ndarray,
        skip: int,
    ) -> list[ContextChunk]:
        """Decode-like queries of `reqs` (indices into the layout), many per chunk, each context
        padded to the longest one: entry o is o in the head, then tail_start - head_end + o.
        The first `skip` positions are left out (a cascade prefix; full attention only)."""
        if len(reqs) == 0:
            return []
        rows = self.layout.rows[reqs]
        head_ends, tail_starts = read_bounds(spec, positions, self.layout.num_prompt_tokens[reqs])
        tail_starts = np.maximum(tail_starts, skip)
        lengths = head_ends + positions - tail_starts + 1
        per_chunk = max(1, GATHER_BUDGET // int(lengths.max()))
        chunks = []
        for lo in range(0, len(rows), per_chunk):
            part = slice(lo, lo + per_chunk)
            num_ctx = int(lengths[part].max())
            offsets = np.arange(num_ctx)[None, :]
            valid = offsets < lengths[part, None]  # [S, L]
            head_end = head_ends[part, None]
            ctx_pos = np.where(
                offsets < head_end, offsets, tail_starts[part, None] - head_end + offsets
            )
            ctx_pos = np.minimum(ctx_pos, positions[part, None])  # padding repeats the query's own
            chunks.append(
                self._chunk(table, rows[part], ctx_pos, token_idx[part, None], valid[:, None, :])
            )
        return chunks

    def _prefill_chunks(
        self, table: BlockTable, spec: KVCacheSpec, req: int, skip: int
    ) -> list[ContextChunk]:
        """One request's queries, split so that queries x context stays within the budget.

        A split's context is the union of its queries' reads: its first query's head and its tail
        onwards (bounds never decrease with the position, and a later query's longer R-SWA head
        lies inside the first one's tail). The engine frees nothing from there on.
        """
        layout = self.layout
        first, count = int(layout.first_positions[req]), int(layout.num_queries[req])
        row, offset = int(layout.rows[req]), int(layout.token_offsets[req])
        num_prompt_tokens = int(layout.num_prompt_tokens[req])
        per_chunk = max(1, GATHER_BUDGET // (first + count - skip))
        chunks = []
        for q_lo in range(first, first + count, per_chunk):
            q_hi = min(q_lo + per_chunk, first + count)
            query_pos = np.arange(q_lo, q_hi)[:, None]  # [n, 1]
            head_ends, tail_starts = read_bounds(spec, query_pos[:, 0], num_prompt_tokens)
            head_end, tail_start = int(head_ends[0]), max(int(tail_starts[0]), skip)
            ctx_pos = np.concatenate((np.arange(head_end), np.arange(tail_start, q_hi)))[None, :]
            visible = read_mask(spec, ctx_pos, query_pos, num_prompt_tokens)  # [n, L]
            query_idx = (offset + query_pos[:, 0] - first)[None, :]
            chunks.append(self._chunk(table, np.array([row]), ctx_pos, query_idx, visible[None]))
        return chunks

    def _chunk(
        self,
        table: BlockTable,
        rows: np.ndarray,
        ctx_pos: np.ndarray,
        query_idx: np.ndarray,
        mask: np.ndarray,
    ) -> ContextChunk:
        num_seqs, num_ctx = ctx_pos.shape
        flat_rows = np.repeat(rows, num_ctx)
        block_idx, offsets = self._block_indices(table, flat_rows, ctx_pos.reshape(-1))
        device = self.device
        return ContextChunk(
            query_idx=torch.from_numpy(np.ascontiguousarray(query_idx, dtype=np.int64)).to(device),
            block_idx=block_idx.view(num_seqs, num_ctx),
            block_offsets=offsets.view(num_seqs, num_ctx),
            positions=torch.from_numpy(ctx_pos.astype(np.int64)).to(device),
            mask=torch.from_numpy(np.ascontiguousarray(mask)).to(device),
        )
