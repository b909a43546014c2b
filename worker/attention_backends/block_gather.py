"""BlockGatherAttention: each context read as whole blocks, one index per block, then SDPA under a
mask that hides the entries its query may not read.

The reference gathers one row per context token (16 small copies per block); this gathers
`block_size` tokens per index, one contiguous copy each, from the first block a query's window
reaches to the block of its last position. Entries before the window, past the query and in
padding blocks are masked, so what a query reads is exactly `read_bounds` of its spec, as in the
reference. Full-attention and sliding-window groups only (a checkpoint's kinds).

On the CPU, half-precision K/V/Q are attended in float32: torch's CPU flash kernel runs 5x slower
in bfloat16 than in float32 at a 16-row decode step (5.1 against 1.0 ms a layer, measured on this
project's 2-core host), and the result is cast back.
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from worker.attention import PagedKV, StepLayout, read_bounds, read_mask
from worker.attention_backends.reference import attend
from worker.block_table import BlockTable

# Queries x context entries per chunk: bounds the float32 scores SDPA may build (x heads).
CHUNK_BUDGET = 1 << 18
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class BlockChunk:
    """S query sequences of n queries each over nb whole blocks of context each."""

    query_idx: torch.Tensor  # [S, n] token index in the step of each query
    block_ids: torch.Tensor  # [S * nb] each sequence's context blocks, in order (padding: null)
    mask: torch.Tensor  # [S, 1, n, nb * block_size] True where the query reads the entry
    # the mask is exactly query i reading entries 0..i (a prompt's first chunk under full
    # attention): SDPA then skips the masked half instead of computing and hiding it
    is_causal: bool = False
    # One query per sequence: each reads entries [start, end) of its blocks' concatenation
    # (int32 [S]), what its mask says in two numbers, for kernels that read blocks in place
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None


class BlockGatherAttention:
    """StepAttention over one step's PagedKV that gathers whole blocks.

    Invariants: a chunk's unmasked entries lie in blocks of the request's table, never in the
    null block; chunks are built once per group and step, and shared by the group's layers.
    """

    def __init__(self, kv: PagedKV) -> None:
        for spec in kv.specs:
            if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
                raise ValueError(
                    f"the blocks attention backend reads full-attention and sliding-window "
                    f"groups, not {type(spec).__name__}"
                )
        self.kv = kv
        self._chunks: dict[tuple[int, bool], list[BlockChunk]] = {}
        # Gathered K/V of one chunk, reused by every layer of the step: a fresh 2-8 MB tensor a
        # layer costs its page faults again each time. Keyed by shape, dtype and K or V.
        self._workspace: dict[tuple[torch.Size, torch.dtype, int], torch.Tensor] = {}

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
        num_tokens, num_heads, head_dim = q.shape
        cache = self.kv.kv_caches[layer_name]  # [num_blocks, 2, block_size, KV_r, head_dim]
        keys, values = cache[:, 0], cache[:, 1]  # each [num_blocks, block_size, KV_r, head_dim]
        num_kv_heads = cache.shape[3]
        on_cpu = q.device.type == "cpu"
        dtype = torch.float32 if on_cpu and q.dtype in HALF_DTYPES else q.dtype
        out = q.new_zeros((num_tokens, num_heads * head_dim))  # [T, H_r * head_dim]
        for chunk in self._group_chunks(self.kv.layer_to_group[layer_name], logits_only):
            if self._attend_in_place(cache, chunk, q, scale, softcap, out):
                continue
            num_seqs = chunk.query_idx.shape[0]
            shape = (num_seqs, -1, num_kv_heads, head_dim)
            k_ctx = self._gather(keys, chunk.block_ids, 0, dtype).view(shape)  # [S, L, KV_r, hd]
            v_ctx = self._gather(values, chunk.block_ids, 1, dtype).view(shape)
            result = attend(
                q[chunk.query_idx].to(dtype).transpose(1, 2),  # [S, H_r, n, head_dim]
                k_ctx.transpose(1, 2),  # [S, KV_r, L, head_dim]
                v_ctx.transpose(1, 2),
                chunk.mask,
                scale,
                not on_cpu,
                softcap,
                chunk.is_causal,
            )  # [S, H_r, n, head_dim]
            rows = result.transpose(1, 2).reshape(-1, num_heads * head_dim)
            out[chunk.query_idx.reshape(-1)] = rows.to(out.dtype)
        return out

    def _attend_in_place(
        self,
        cache: torch.Tensor,
        chunk: BlockChunk,
        q: torch.Tensor,
        scale: float,
        softcap: float | None,
        out: torch.Tensor,
    ) -> bool:
        """A subclass's kernel that reads `chunk`'s blocks in place, writing its rows of `out`;
        False: gather and attend here."""
        return False

    def _gather(
        self, blocks: torch.Tensor, block_ids: torch.Tensor, kind: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Blocks `block_ids` of `blocks` [num_blocks, block_size, KV_r, head_dim] (K or V:
        `kind`) in `dtype`, in a workspace tensor that the next layer overwrites."""
        shape = torch.Size((len(block_ids), *blocks.shape[1:]))  # [S * nb, bs, KV_r, head_dim]
        gathered = self._buffer(shape, blocks.dtype, kind)
        torch.index_select(blocks, 0, block_ids, out=gathered)
        if dtype == blocks.dtype:
            return gathered
        converted = self._buffer(shape, dtype, kind)
        return converted.copy_(gathered)

    def _buffer(self, shape: torch.Size, dtype: torch.dtype, kind: int) -> torch.Tensor:
        key = (shape, dtype, kind)
        if key not in self._workspace:
            self._workspace[key] = torch.empty(shape, dtype=dtype, device=self.kv.device)
        return self._workspace[key]

    def _group_chunks(self, group_idx: int, logits_only: bool) -> list[BlockChunk]:
        logits_only = logits_only and not self.kv.layout.has_prompt_logits  # every row's logits
        key = (group_idx, logits_only)
        if key not in self._chunks:
            self._chunks[key] = self._build_chunks(group_idx, logits_only)
        return self._chunks[key]

    def _build_chunks(self, group_idx: int, logits_only: bool) -> list[BlockChunk]:
        layout, spec = self.kv.layout, self.kv.specs[group_idx]
        table = self.kv.tables[group_idx]
        last_positions = layout.first_positions + layout.num_queries - 1
        last_tokens = layout.token_offsets + layout.num_queries - 1
        if logits_only:
            reqs = layout.logits_reqs
            return self._single_query_chunks(
                table, spec, layout, reqs, last_positions[reqs], last_tokens[reqs]
            )
        singles = np.flatnonzero(layout.num_queries == 1)
        chunks = self._single_query_chunks(
            table, spec, layout, singles, last_positions[singles], last_tokens[singles]
        )
        for req in np.flatnonzero(layout.num_queries > 1):
            chunks.extend(self._prefill_chunks(table, spec, layout, int(req)))
        return chunks

    def _single_query_chunks(
        self,
        table: BlockTable,
        spec: KVCacheSpec,
        layout: StepLayout,
        reqs: np.ndarray,
        positions: np.ndarray,
        token_idx: np.ndarray,
    ) -> list[BlockChunk]:
        """One query per sequence (decodes, and the last layer's sampled tokens), many per chunk,
        each padded to the most blocks any of them reads."""
        if len(reqs) == 0:
            return []
        block_size = table.block_size
        _, tail_starts = read_bounds(spec, positions, layout.num_prompt_tokens[reqs])
        first_blocks = tail_starts // block_size
        num_blocks = positions // block_size - first_blocks + 1
        per_chunk = max(1, CHUNK_BUDGET // (int(num_blocks.max()) * block_size))
        chunks = []
        starts = (tail_starts - first_blocks * block_size).astype(np.int32)
        ends = (positions - first_blocks * block_size + 1).astype(np.int32)
        for lo in range(0, len(reqs), per_chunk):
            part = slice(lo, lo + per_chunk)
            chunk = self._chunk(
                table,
                spec,
                layout.rows[reqs[part]],
                first_blocks[part],
                int(num_blocks[part].max()),
                positions[part, None],  # [S, 1]
                token_idx[part, None],
                layout.num_prompt_tokens[reqs[part]],
            )
            chunks.append(replace(chunk, starts=starts[part], ends=ends[part]))
        return chunks

    def _prefill_chunks(
        self, table: BlockTable, spec: KVCacheSpec, layout: StepLayout, req: int
    ) -> list[BlockChunk]:
        """One request's queries, split so that queries x context stays within the budget; a
        split reads from the first block its first query's window reaches."""
        block_size = table.block_size
        first, count = int(layout.first_positions[req]), int(layout.num_queries[req])
        num_prompt_tokens = layout.num_prompt_tokens[req : req + 1]
        per_chunk = max(1, CHUNK_BUDGET // (first + count))
        chunks = []
        for q_lo in range(first, first + count, per_chunk):
            q_hi = min(q_lo + per_chunk, first + count)
            _, tail_starts = read_bounds(spec, np.array([q_lo]), num_prompt_tokens)
            first_block = int(tail_starts[0]) // block_size
            num_blocks = (q_hi - 1) // block_size - first_block + 1
            query_pos = np.arange(q_lo, q_hi)[None, :]  # [1, n]
            token_idx = layout.token_offsets[req] + query_pos - first
            chunks.append(
                self._chunk(
                    table,
                    spec,
                    layout.rows[req : req + 1],
                    np.array([first_block]),
                    num_blocks,
                    query_pos,
                    token_idx,
                    num_prompt_tokens,
                )
            )
        return chunks

    def _chunk(
        self,
        table: BlockTable,
        spec: KVCacheSpec,
        rows: np.ndarray,
        first_blocks: np.ndarray,
        num_blocks: int,
        query_pos: np.ndarray,
        token_idx: np.ndarray,
        num_prompt_tokens: np.ndarray,
    ) -> BlockChunk:
        """Sequences `rows` reading blocks [first_block, first_block + num_blocks) of their
        tables; block indices past a row's table read the null block, masked."""
        block_size = table.block_size
        block_idx = first_blocks[:, None] + np.arange(num_blocks)  # [S, nb]
        in_table = block_idx < table.num_blocks_per_row[rows, None]
        block_ids = np.where(
            in_table,
            table.block_table[
                rows[:, None], np.minimum(block_idx, table.max_num_blocks_per_req - 1)
            ],
            NULL_BLOCK_ID,
        )
        ctx_pos = (first_blocks[:, None] * block_size + np.arange(num_blocks * block_size))[
            :, None, :
        ]  # [S, 1, L]
        mask = read_mask(
            spec, ctx_pos, query_pos[:, :, None], num_prompt_tokens[:, None, None]
        )  # [S, n, L]
        read_blocks = mask.any(axis=1).reshape(len(rows), num_blocks, block_size).any(axis=2)
        if (read_blocks & (block_ids == NULL_BLOCK_ID)).any():
            seq, block = np.argwhere(read_blocks & (block_ids == NULL_BLOCK_ID))[0]
            raise ValueError(
                f"row {int(rows[seq])} reads block {int(block_idx[seq, block])} of its table, "
                "which maps to the null block"
            )
        device = self.kv.device
        num_queries = mask.shape[1]
        is_causal = (
            len(rows) == 1
            and num_queries > 1
            and np.array_equal(mask[0], np.tri(num_queries, mask.shape[2], dtype=bool))
        )
        return BlockChunk(
            query_idx=torch.from_numpy(np.ascontiguousarray(token_idx, dtype=np.int64)).to(device),
            block_ids=torch.from_numpy(block_ids.reshape(-1).astype(np.int64)).to(device),
            mask=torch.from_numpy(np.ascontiguousarray(mask[:, None])).to(device),
            is_causal=is_causal,
        )
