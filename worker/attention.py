"""PagedKV: one step's view of the paged KV cache: writes new K/V, gathers each query's context.

A query at position p reads positions [p - window + 1, p] (or [0, p] for full attention), always
through the block table. It never gathers a position outside its window: the engine may already
have freed those blocks. Context indices are built once per group and step and reused by its layers.
"""

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from protocol.kv_cache_spec import NULL_BLOCK_ID, KVCacheConfig, SlidingWindowSpec
from worker.block_table import BlockTable, MultiGroupBlockTable

GATHER_BUDGET = 1 << 15  # query x context entries per chunk; bounds the gathered K/V and scores


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each scheduled request's queries sit: request i owns tokens [offset, offset + n)."""

    rows: np.ndarray  # [R] batch row of each scheduled request
    first_positions: np.ndarray  # [R] num_computed_tokens: position of its first scheduled token
    num_queries: np.ndarray  # [R] its scheduled token count
    token_offsets: np.ndarray  # [R] index of its first token in the flattened batch
    logits_reqs: np.ndarray  # [S] the requests sampled this step (their chunk reaches the end)


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


def _window_start(positions: np.ndarray, window: int | None) -> np.ndarray:
    if window is None:
        return np.zeros_like(positions)
    return np.maximum(positions - window + 1, 0)


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
    ) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.layout = layout
        self.tables = tables
        self.layer_to_group: dict[str, int] = {}
        self.windows: list[int | None] = []
        for group_idx, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                self.layer_to_group[name] = group_idx
            spec = group.spec
            self.windows.append(
                spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            )
        token_rows = np.repeat(layout.rows, layout.num_queries)
        token_positions = self._token_positions()
        self.write_indices = [
            self._block_indices(table, token_rows, token_positions) for table in tables.tables
        ]
        self._chunks: dict[tuple[int, bool], list[ContextChunk]] = {}
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
        cache = self.kv_caches[layer_name]
        block_idx, offsets = self.write_indices[self.layer_to_group[layer_name]]
        cache[block_idx, 0, offsets] = k.to(cache.dtype)
        cache[block_idx, 1, offsets] = v.to(cache.dtype)

    def gather(self, layer_name: str, chunk: ContextChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [S, L, num_kv_heads_per_rank, head_dim] of a chunk's context, in cache dtype."""
        cache = self.kv_caches[layer_name]
        return cache[chunk.block_idx, 0, chunk.block_offsets], cache[
            chunk.block_idx, 1, chunk.block_offsets
        ]

    def chunks(self, layer_name: str, logits_only: bool = False) -> list[ContextChunk]:
        """Context chunks of every scheduled token, or only of each sampled request's last token."""
        group_idx = self.layer_to_group[layer_name]
        key = (group_idx, logits_only)
        if key not in self._chunks:
            start = time.perf_counter()
            self._chunks[key] = self._build_chunks(group_idx, logits_only)
            self.build_s += time.perf_counter() - start
        return self._chunks[key]

    def _build_chunks(self, group_idx: int, logits_only: bool) -> list[ContextChunk]:
        layout, window = self.layout, self.windows[group_idx]
        table = self.tables[group_idx]
        last_positions = layout.first_positions + layout.num_queries - 1
        if logits_only:
            reqs = layout.logits_reqs
            single = (
                layout.rows[reqs],
                last_positions[reqs],
                layout.token_offsets[reqs] + layout.num_queries[reqs] - 1,
            )
            return self._single_query_chunks(table, window, *single)
        is_single = layout.num_queries == 1
        chunks = self._single_query_chunks(
            table,
            window,
            layout.rows[is_single],
            layout.first_positions[is_single],
            layout.token_offsets[is_single],
        )
        for req in np.flatnonzero(~is_single):
            chunks.extend(self._prefill_chunks(table, window, req))
        return chunks

    def _single_query_chunks(
        self,
        table: BlockTable,
        window: int | None,
        rows: np.ndarray,
        positions: np.ndarray,
        token_idx: np.ndarray,
    ) -> list[ContextChunk]:
        """Decode-like queries, many per chunk, each context padded to the longest one."""
        if len(rows) == 0:
            return []
        starts = _window_start(positions, window)
        lengths = positions - starts + 1
        per_chunk = max(1, GATHER_BUDGET // int(lengths.max()))
        chunks = []
        for lo in range(0, len(rows), per_chunk):
            part = slice(lo, lo + per_chunk)
            num_ctx = int(lengths[part].max())
            offsets = np.arange(num_ctx)[None, :]
            valid = offsets < lengths[part, None]  # [S, L]
            ctx_pos = np.minimum(starts[part, None] + offsets, positions[part, None])
            chunks.append(
                self._chunk(table, rows[part], ctx_pos, token_idx[part, None], valid[:, None, :])
            )
        return chunks

    def _prefill_chunks(
        self, table: BlockTable, window: int | None, req: int
    ) -> list[ContextChunk]:
        """One request's queries, split so that queries x context stays within the budget."""
        layout = self.layout
        first, count = int(layout.first_positions[req]), int(layout.num_queries[req])
        row, offset = int(layout.rows[req]), int(layout.token_offsets[req])
        per_chunk = max(1, GATHER_BUDGET // (first + count))
        chunks = []
        for q_lo in range(first, first + count, per_chunk):
            q_hi = min(q_lo + per_chunk, first + count)
            ctx_lo = int(_window_start(np.array([q_lo]), window)[0])
            ctx_pos = np.arange(ctx_lo, q_hi)[None, :]  # [1, L]
            query_pos = np.arange(q_lo, q_hi)[:, None]  # [n, 1]
            visible = ctx_pos <= query_pos
            if window is not None:
                visible &= ctx_pos > query_pos - window
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
