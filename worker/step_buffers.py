"""StepBuffers: the persistent buffers a step's inputs are prepared into, once, before the forward,
and the device-resident block tables they index; the sampled ids' way back to the host.

On CUDA the host side is pinned and reaches the device in one non-blocking copy per step; on the
CPU the host tensors are the device's. It never runs a model, and nothing it hands a forward
needs the host: slot mappings and each request's table rows are computed on the device.
"""

from dataclasses import dataclass

import numpy as np
import torch

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from worker.attention import StepLayout
from worker.block_table import MultiGroupBlockTable

NO_SLOT = -1  # a padded token's slot: the KV store writes nothing there
INITIAL_CHANGES = 1024  # block-table entries one upload holds at first; doubles when short
# The step's columns, back to back in this order in one int64 buffer (see `column_slices`)
COLUMNS = (
    "token_ids",
    "positions",
    "token_rows",
    "req_rows",
    "seq_lens",
    "query_start_loc",
    "logits_idx",
    "logits_rows",
    "logits_seq_lens",
    "logits_query_start_loc",
)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest step the engine schedules: the step buffers are allocated for it, once."""

    max_num_tokens: int  # the engine's max_num_batched_tokens
    max_num_reqs: int  # the engine's max_num_seqs

    @property
    def max_decode_batch(self) -> int:
        """Requests a decode step holds at most: each brings one token."""
        return min(self.max_num_tokens, self.max_num_reqs)


@dataclass(frozen=True, slots=True)
class StepShape:
    """A prepared step's sizes, padding included; the three counts fix every column's address."""

    num_tokens: int  # T
    num_reqs: int  # R
    num_sampled: int  # S
    max_query_len: int  # tiles the kernels (1 for every decode step, padded or not)
    max_seq_len: int  # bounds the interpreted kernel's loop; compiled kernels never read it


@dataclass(frozen=True, slots=True)
class StepColumns:
    """One step's inputs as int64 host columns. A padded request (a decode step filled up to a
    graph's batch size) owns no query, reads no context, and its token writes to no slot."""

    token_ids: np.ndarray  # [T]; 0 for a padded token
    positions: np.ndarray  # [T]; 0 for a padded token
    token_rows: np.ndarray  # [T] batch row of each token's request; -1 for a padded token
    req_rows: np.ndarray  # [R] batch row of each request; 0 (never read) for a padded one
    seq_lens: np.ndarray  # [R] context length after the step, its queries included; 0 padded
    query_start_loc: np.ndarray  # [R + 1] request r owns tokens [start[r], start[r + 1])
    logits_idx: np.ndarray  # [S] each sampled request's last token; a padded token when padded
    logits_rows: np.ndarray  # [S] batch row of each sampled request; 0 for a padded one
    logits_seq_lens: np.ndarray  # [S] its context length; 0 for a padded one
    logits_query_start_loc: np.ndarray  # [S + 1] sampled request s owns logits query s
    max_query_len: int
    max_seq_len: int

    @property
    def shape(self) -> StepShape:
        return StepShape(
            len(self.token_ids),
            len(self.req_rows),
            len(self.logits_idx),
            self.max_query_len,
            self.max_seq_len,
        )


def is_decode_only(layout: StepLayout) -> bool:
    """Every request schedules one token and samples it: the steps a graph can replay."""
    return bool((layout.num_queries == 1).all()) and len(layout.logits_reqs) == len(layout.rows)


def step_columns(
    layout: StepLayout, token_ids: np.ndarray, positions: np.ndarray, num_padded_reqs: int = 0
) -> StepColumns:
    """The step's columns; a decode-only step may be padded by `num_padded_reqs` requests."""
    if num_padded_reqs and not is_decode_only(layout):
        raise ValueError(f"only a decode-only step is padded, not one of {layout.num_queries}")
    assert np.array_equal(layout.token_offsets, np.cumsum(layout.num_queries) - layout.num_queries)
    num_tokens, pad = len(token_ids), np.zeros(num_padded_reqs, np.int64)
    seq_lens = (layout.first_positions + layout.num_queries).astype(np.int64)
    reqs = layout.logits_reqs
    logits_idx = layout.token_offsets[reqs] + layout.num_queries[reqs] - 1
    padded_tokens = np.arange(num_tokens, num_tokens + num_padded_reqs)  # a token per request
    starts = np.concatenate(([0], np.cumsum(layout.num_queries)))  # [R + 1]
    return StepColumns(
        token_ids=np.concatenate((token_ids, pad)),
        positions=np.concatenate((positions, pad)),
        token_rows=np.concatenate((np.repeat(layout.rows, layout.num_queries), pad - 1)),
        req_rows=np.concatenate((layout.rows, pad)),
        seq_lens=np.concatenate((seq_lens, pad)),
        query_start_loc=np.concatenate((starts, pad + num_tokens)),
        logits_idx=np.concatenate((logits_idx, padded_tokens)),
        logits_rows=np.concatenate((layout.rows[reqs], pad)),
        logits_seq_lens=np.concatenate((seq_lens[reqs], pad)),
        logits_query_start_loc=np.concatenate((np.arange(len(reqs) + 1), pad + len(reqs))),
        max_query_len=1 if num_padded_reqs else int(layout.num_queries.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )


def column_slices(shape: StepShape) -> dict[str, slice]:
    """Where each column of a step of `shape` sits in the int64 buffer: back to back."""
    t, r, s = shape.num_tokens, shape.num_reqs, shape.num_sampled
    lengths = (t, t, t, r, r, r + 1, s, s, s, s + 1)
    ends = np.cumsum(lengths).tolist()
    return {name: slice(end - n, end) for name, n, end in zip(COLUMNS, lengths, ends, strict=True)}


def buffer_length(limits: StepLimits) -> int:
    """Entries of the int64 buffer: the columns of the largest step (S <= R)."""
    shape = StepShape(limits.max_num_tokens, limits.max_num_reqs, limits.max_num_reqs, 0, 0)
    return column_slices(shape)[COLUMNS[-1]].stop


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """What the Triton `paged_attention` reads besides q and the cache, for one group's queries
    of a step: every scheduled token's, or (logits only) each sampled request's last one."""

    block_table: torch.Tensor  # [R, max_blocks] int32 block ids of each request's context
    seq_lens: torch.Tensor  # [R] int32 context length of each request, its queries included
    query_start_loc: torch.Tensor  # [R + 1] int32 request r owns queries [start[r], start[r + 1])
    max_query_len: int
    max_seq_len: int
    token_idx: torch.Tensor | None  # [R] step token of each query when logits only; None: all


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """One step's inputs on the device, as the step buffers computed them: what a checkpoint's
    forward reads in place of a PagedKV (worker/attention_backends/triton_backend.py)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_idx: torch.Tensor  # [S] int64 indices into T
    kv_caches: dict[str, torch.Tensor]
    layer_to_group: dict[str, int]
    specs: list[KVCacheSpec]
    slot_mappings: list[torch.Tensor]  # per group [T] int64; NO_SLOT for a padded token
    attention: list[AttentionInputs]  # per group, every scheduled token's queries
    logits_attention: list[AttentionInputs]  # per group, each sampled request's last query


class HostToDevice:
    """An int64 host buffer and its device twin: pinned, with non-blocking copies, on CUDA; one
    tensor on the CPU."""

    def __init__(self, length: int, device: torch.device) -> None:
        self.is_copied = device.type == "cuda"
        self.host = torch.zeros(length, dtype=torch.int64, pin_memory=self.is_copied)  # [length]
        self.host_view = self.host.numpy()
        # [length]: what the device reads
        self.device = torch.zeros_like(self.host, device=device) if self.is_copied else self.host

    def upload(self, length: int) -> None:
        """Copy the first `length` entries to the device, without waiting for the copy."""
        if self.is_copied and length:
            self.device[:length].copy_(self.host[:length], non_blocking=True)


class StepBuffers:
    """One rank's step inputs in persistent buffers, and its block tables on the device.

    Per step, `stage` writes the columns into the host buffer (after the previous step's copy
    has finished with it), brings the device's block tables up to date by the entries the
    InputBatch's tables wrote since (`BlockTable.take_changes`), and copies the columns over;
    `device_step` then derives on the device what the forward reads. A graph captures
    `device_step` and the forward together: a step of one shape reads the same addresses.

    Invariants: after `stage`, `block_tables[g, r, :width_g]` equals row r of group g's host
    table for every r < max_num_reqs, and is 0 past width_g; every group is full attention or
    a sliding window (the only kinds the Triton backend reads).
    """

    def __init__(
        self,
        tables: MultiGroupBlockTable,
        kv_cache_config: KVCacheConfig,
        kv_caches: dict[str, torch.Tensor],
        limits: StepLimits,
        device: torch.device,
    ) -> None:
        self.specs = [group.spec for group in kv_cache_config.kv_cache_groups]
        for spec in self.specs:
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                raise ValueError(f"step buffers serve attention groups only, not {spec}")
        self.layer_to_group = {
            name: group_idx
            for group_idx, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.tables, self.kv_caches, self.device = tables, kv_caches, device
        self.max_num_tokens, self.max_num_reqs = limits.max_num_tokens, limits.max_num_reqs
        self.width = max(table.max_num_blocks_per_req for table in tables.tables)
        # [num_groups, max_num_reqs, width] int32: each group's table, zeros past its width
        self.block_tables = torch.zeros(
            (len(tables), self.max_num_reqs, self.width), dtype=torch.int32, device=device
        )
        for table in tables.tables:
            table.track_changes()
        self.inputs = HostToDevice(buffer_length(limits), device)
        self.changes = HostToDevice(2 * INITIAL_CHANGES, device)  # entries, then their values
        # recorded once a step's copies are queued; the host buffers are rewritten only after it
        self.uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def stage(
        self,
        layout: StepLayout,
        token_ids: np.ndarray,
        positions: np.ndarray,
        num_padded_reqs: int = 0,
    ) -> StepShape:
        """Prepare the step (padded by `num_padded_reqs` decode requests) on the device."""
        columns = step_columns(layout, token_ids, positions, num_padded_reqs)
        shape = columns.shape
        if shape.num_tokens > self.max_num_tokens or shape.num_reqs > self.max_num_reqs:
            raise ValueError(
                f"a step of {shape.num_tokens} tokens and {shape.num_reqs} requests exceeds the "
                f"step buffers' {self.max_num_tokens} tokens and {self.max_num_reqs} requests"
            )
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the previous step's copies have left the host buffers
        self._update_block_tables()
        slices = column_slices(shape)
        for name, part in slices.items():
            self.inputs.host_view[part] = getattr(columns, name)
        self.inputs.upload(slices[COLUMNS[-1]].stop)
        if self.uploaded is not None:  # on the stream the copies went to: the device's current
            self.uploaded.record(torch.cuda.current_stream(self.device))
        return shape

    def _update_block_tables(self) -> None:
        """Copy the entries the host tables wrote since the last step, and nothing else."""
        flat_idx, values = [], []
        for group_idx, table in enumerate(self.tables.tables):
            rows, columns = table.take_changes()
            if len(rows) and int(rows.max()) >= self.max_num_reqs:
                raise ValueError(
                    f"group {group_idx} wrote row {int(rows.max())}, but the device holds "
                    f"max_num_reqs={self.max_num_reqs} rows"
                )
            flat_idx.append((group_idx * self.max_num_reqs + rows) * self.width + columns)
            values.append(table.block_table[rows, columns])
        num_changes = sum(len(idx) for idx in flat_idx)
        if not num_changes:
            return
        if 2 * num_changes > len(self.changes.host):
            self.changes = HostToDevice(4 * num_changes, self.device)
        host = self.changes.host_view
        host[:num_changes] = np.concatenate(flat_idx)
        host[num_changes : 2 * num_changes] = np.concatenate(values)
        self.changes.upload(2 * num_changes)
        changes = self.changes.device
        self.block_tables.view(-1).index_copy_(
            0, changes[:num_changes], changes[num_changes : 2 * num_changes].to(torch.int32)
        )

    def device_step(self, shape: StepShape) -> DeviceStep:
        """The staged step of `shape` as the forward reads it, computed on the device alone."""
        column = {name: self.inputs.device[part] for name, part in column_slices(shape).items()}
        positions, token_rows = column["positions"], column["token_rows"]
        is_padding = token_rows < 0
        slot_rows = token_rows.clamp(min=0) * self.width
        seq_lens = column["seq_lens"].to(torch.int32)
        query_start_loc = column["query_start_loc"].to(torch.int32)
        logits_seq_lens = column["logits_seq_lens"].to(torch.int32)
        logits_query_start_loc = column["logits_query_start_loc"].to(torch.int32)
        slot_mappings, attention, logits_attention = [], [], []
        for group_idx, table in enumerate(self.tables.tables):
            block_size, group_table = table.block_size, self.block_tables[group_idx]
            # slot = block_table[row, position // block_size] * block_size + position % block_size
            block_ids = group_table.view(-1)[slot_rows + positions // block_size]
            slots = block_ids.to(torch.int64) * block_size + positions % block_size
            slot_mappings.append(slots.masked_fill(is_padding, NO_SLOT))
            attention.append(
                AttentionInputs(
                    group_table.index_select(0, column["req_rows"]),  # [R, width]
                    seq_lens,
                    query_start_loc,
                    shape.max_query_len,
                    shape.max_seq_len,
                    None,
                )
            )
            logits_attention.append(
                AttentionInputs(
                    group_table.index_select(0, column["logits_rows"]),  # [S, width]
                    logits_seq_lens,
                    logits_query_start_loc,
                    min(1, shape.num_sampled),
                    shape.max_seq_len,
                    column["logits_idx"],
                )
            )
        return DeviceStep(
            column["token_ids"],
            positions,
            column["logits_idx"],
            self.kv_caches,
            self.layer_to_group,
            self.specs,
            slot_mappings,
            attention,
            logits_attention,
        )

    def check_invariants(self) -> None:
        """The device's block tables equal the host's, but for the entries written since the
        last `stage`, which the next one copies (a device-to-host copy: tests only)."""
        device_tables = self.block_tables.cpu().numpy()
        for group_idx, table in enumerate(self.tables.tables):
            rows = min(self.max_num_reqs, table.max_num_reqs)
            width = table.max_num_blocks_per_req
            mirror = device_tables[group_idx]
            is_pending = np.zeros((rows, width), dtype=bool)  # [rows, width]
            for row, start, end in table.changed_spans or []:
                if row < rows:
                    is_pending[row, start:end] = True
            differs = (mirror[:rows, :width] != table.block_table[:rows]) & ~is_pending
            assert not differs.any(), (
                f"group {group_idx}'s device block table differs from the host's in rows "
                f"{np.flatnonzero(differs.any(1)).tolist()}"
            )
            assert not mirror[:, width:].any(), f"group {group_idx} holds ids past its width"


class SampledIdsCopy:
    """The sampled ids' way to the host: on CUDA one non-blocking copy into pinned memory and an
    event, waited on only when the ids are read; elsewhere the tensor itself."""

    def __init__(self, device: torch.device) -> None:
        self.is_copied = device.type == "cuda"
        self.host = torch.zeros(0, dtype=torch.int64, pin_memory=self.is_copied)  # [capacity]
        self.copied = torch.cuda.Event() if self.is_copied else None
        self.ids: torch.Tensor | None = None  # what `wait` reads: the pinned copy or the ids

    def start(self, sampled_ids: torch.Tensor) -> None:
        """Queue the copy of `sampled_ids` [S] int64 to the host."""
        if self.copied is None or sampled_ids.device.type != "cuda":
            self.ids = sampled_ids
            return
        self.copied.synchronize()  # the previous copy has landed before its buffer is reused
        num_ids = len(sampled_ids)
        if num_ids > len(self.host):
            self.host = torch.zeros(2 * num_ids, dtype=torch.int64, pin_memory=True)
        self.ids = self.host[:num_ids]
        self.ids.copy_(sampled_ids, non_blocking=True)
        self.copied.record(torch.cuda.current_stream(sampled_ids.device))

    def wait(self) -> np.ndarray:
        """The ids of the last `start` on the host: a view valid until the next `start`."""
        assert self.ids is not None, "wait before start"
        if self.copied is not None:
            self.copied.synchronize()
        return self.ids.numpy() if self.ids.device.type == "cpu" else self.ids.cpu().numpy()
