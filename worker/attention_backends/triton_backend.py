"""TritonBackend: one step's K/V writes and attention through the Triton kernels, in place of
PagedKV's gather and torch's SDPA (worker/attention_backends/reference.py), with the same results.

It owns the kernels' metadata of one step: built from a PagedKV once per KV-cache group and reused
by all of the group's layers, or read as the step buffers computed it on the device (a DeviceStep,
worker/step_buffers.py: what a CUDA graph replays). Importing it imports triton: only a CUDA
worker may import it, never the CPU path.
"""

import numpy as np
import torch

from protocol.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from worker.attention import PagedKV
from worker.attention_backends.triton_kernels import paged_attention, store_kv
from worker.step_buffers import AttentionInputs, DeviceStep


class TritonBackend:
    """Writes and attends one step's layers with the Triton kernels, reading `kv`'s block tables.

    Like the gather path, it reads each context whole: no cascade attention.

    Invariant: a group's metadata, once built, is never rebuilt or changed within the step; its
    slot mapping is PagedKV's own (`kv.write_indices`), so both write the same slots, or the
    DeviceStep's, which the step buffers computed from the same block tables.
    """

    def __init__(self, kv: PagedKV | DeviceStep) -> None:
        self.kv = kv
        self._slot_mappings: dict[int, torch.Tensor] = {}  # group -> [T] int64 slot of each token
        self._inputs: dict[tuple[int, bool], AttentionInputs] = {}  # by (group, logits_only)
        if isinstance(kv, DeviceStep):  # computed before the forward: nothing is built here
            for group_idx, slot_mapping in enumerate(kv.slot_mappings):
                self._slot_mappings[group_idx] = slot_mapping
                self._inputs[(group_idx, False)] = kv.attention[group_idx]
                self._inputs[(group_idx, True)] = kv.logits_attention[group_idx]

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [T, num_kv_heads_per_rank, head_dim] of every scheduled token."""
        group_idx = self._group(layer_name)
        if group_idx not in self._slot_mappings:
            assert isinstance(self.kv, PagedKV)  # a DeviceStep brought every group's
            block_idx, offsets = self.kv.write_indices[group_idx]
            block_size = self.kv.tables[group_idx].block_size
            self._slot_mappings[group_idx] = block_idx * block_size + offsets  # [T]
        store_kv(self.kv.kv_caches[layer_name], k, v, self._slot_mappings[group_idx])

    def attend(
        self,
        layer_name: str,
        q: torch.Tensor,
        scale: float,
        logits_only: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Each query's attention over what its layer's spec lets it read, as
        `worker.attention_backends.reference.paged_attention`: [T, H_r * head_dim] in q's dtype.

        Args:
            q: [T, H_r, head_dim], rotated.
            logits_only: only each sampled request's last token attends; other rows stay zero.
            softcap: scores become softcap * tanh(score / softcap) before masking (Gemma 2).
        """
        group_idx = self._group(layer_name)
        spec = self.kv.specs[group_idx]
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        inputs = self._attention_inputs(group_idx, logits_only)
        num_tokens, num_heads, head_dim = q.shape
        out = q.new_zeros((num_tokens, num_heads, head_dim))  # [T, H_r, head_dim]
        queries = q if inputs.token_idx is None else q[inputs.token_idx]  # [R or T, H_r, hd]
        result = out if inputs.token_idx is None else torch.zeros_like(queries)
        paged_attention(
            queries,
            self.kv.kv_caches[layer_name],
            inputs.block_table,
            inputs.seq_lens,
            inputs.query_start_loc,
            inputs.max_query_len,
            inputs.max_seq_len,
            scale,
            window,
            softcap,
            result,
        )
        if inputs.token_idx is not None:
            out[inputs.token_idx] = result
        return out.view(num_tokens, num_heads * head_dim)

    def _group(self, layer_name: str) -> int:
        """The layer's KV-cache group, refused unless its spec is one the kernels read."""
        group_idx = self.kv.layer_to_group[layer_name]
        spec = self.kv.specs[group_idx]
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(
                f"layer {layer_name} is in KV-cache group {group_idx} of kind "
                f"{type(spec).__name__}: the Triton backend reads only FullAttentionSpec and "
                f"SlidingWindowSpec groups"
            )
        return group_idx

    def _attention_inputs(self, group_idx: int, logits_only: bool) -> AttentionInputs:
        key = (group_idx, logits_only)
        if key not in self._inputs:
            self._inputs[key] = self._build_inputs(group_idx, logits_only)
        return self._inputs[key]

    def _build_inputs(self, group_idx: int, logits_only: bool) -> AttentionInputs:
        """Per request: its block table row, its context length after the step, and its queries
        (all of its scheduled tokens, or, logits only, the last one of each sampled request)."""
        assert isinstance(self.kv, PagedKV)  # a DeviceStep brought every group's inputs
        layout, table, device = self.kv.layout, self.kv.tables[group_idx], self.kv.device
        seq_lens = layout.first_positions + layout.num_queries
        expected_offsets = np.cumsum(layout.num_queries) - layout.num_queries
        if not np.array_equal(layout.token_offsets, expected_offsets):
            raise ValueError(
                f"step tokens at offsets {layout.token_offsets.tolist()}: the kernels expect "
                f"each request's tokens right after the previous one's, {expected_offsets.tolist()}"
            )
        if logits_only:
            reqs = layout.logits_reqs
            num_queries = np.ones(len(reqs), dtype=np.int64)
        else:
            reqs = np.arange(len(layout.rows))
            num_queries = layout.num_queries
        rows = layout.rows[reqs]
        max_blocks = max(1, int(table.num_blocks_per_row[rows].max(initial=0)))
        query_start_loc = np.concatenate(([0], np.cumsum(num_queries)))  # [R + 1]
        last_tokens = layout.token_offsets[reqs] + layout.num_queries[reqs] - 1  # [R]

        def to_device(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(device)

        return AttentionInputs(
            block_table=to_device(table.block_table[rows, :max_blocks], np.int32),
            seq_lens=to_device(seq_lens[reqs], np.int32),
            query_start_loc=to_device(query_start_loc, np.int32),
            max_query_len=int(num_queries.max(initial=0)),
            max_seq_len=int(seq_lens[reqs].max(initial=0)),
            token_idx=to_device(last_tokens, np.int64) if logits_only else None,
        )
