"""BlockTable: the worker's copy of each running request's block ids for one KV-cache group.

It maps a (row, position) to a slot of the paged cache. It never allocates blocks: the engine owns
the one BlockPool and sends the ids; this table only records them row by row.
"""

import numpy as np

from protocol.kv_cache_spec import cdiv


class BlockTable:
    """Block ids of the batch rows of one KV-cache group, as an int32 array.

    Invariants:
    - `block_table` is [max_num_reqs, max_num_blocks_per_req] int32 and `num_blocks_per_row` is
      [max_num_reqs] int32 with 0 <= num_blocks_per_row[r] <= max_num_blocks_per_req.
    - Entries at or past `num_blocks_per_row[r]` in row r are 0 and are never read.
    - No entry is negative (block ids index the paged cache; 0 is the null block).
    - Once `track_changes` is called, every entry written since the last `take_changes` lies in
      a recorded span, so a copy updated by those entries alone stays equal to the table.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        if max_num_reqs < 1 or max_num_blocks_per_req < 1 or block_size < 1:
            raise ValueError(
                f"block table sizes must be positive: max_num_reqs={max_num_reqs}, "
                f"max_num_blocks_per_req={max_num_blocks_per_req}, block_size={block_size}"
            )
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # [max_num_reqs, max_num_blocks_per_req]
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)  # [max_num_reqs]
        # (row, start, end): columns [start, end) of the row written since the last
        # take_changes; None: nobody mirrors the table (worker/step_buffers.py does on CUDA)
        self.changed_spans: list[tuple[int, int, int]] | None = None

    @property
    def max_num_reqs(self) -> int:
        return self.block_table.shape[0]

    def grow(self, max_num_reqs: int) -> None:
        """Make room for at least `max_num_reqs` rows, keeping every row as it is."""
        if max_num_reqs <= self.max_num_reqs:
            return
        extra = max_num_reqs - self.max_num_reqs
        # [max_num_reqs, max_num_blocks_per_req] and [max_num_reqs]: old rows first, then zeros
        self.block_table = np.vstack(
            (self.block_table, np.zeros((extra, self.max_num_blocks_per_req), dtype=np.int32))
        )
        self.num_blocks_per_row = np.concatenate(
            (self.num_blocks_per_row, np.zeros(extra, dtype=np.int32))
        )

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        """Append `block_ids` after the blocks row `row_idx` already holds."""
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row_idx} would hold {end} blocks, more than max_num_blocks_per_req="
                f"{self.max_num_blocks_per_req}"
            )
        self.block_table[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end
        self._record(row_idx, start, end)

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        """Replace row `row_idx` with exactly `block_ids`."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        self._record(row_idx, 0, int(self.num_blocks_per_row[row_idx]))
        self.block_table[row_idx, : self.num_blocks_per_row[row_idx]] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row `src` onto row `tgt` and clear `src` (the batch compacts into the hole)."""
        if src == tgt:
            return
        num_blocks = int(self.num_blocks_per_row[src])
        self.clear_row(tgt)
        self.block_table[tgt, :num_blocks] = self.block_table[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks
        self._record(tgt, 0, num_blocks)
        self.clear_row(src)

    def track_changes(self) -> None:
        """Record every entry written from now on, and every block the rows hold already: a
        copy that starts as zeros catches up with the first `take_changes`."""
        self.changed_spans = [
            (row, 0, int(num_blocks))
            for row, num_blocks in enumerate(self.num_blocks_per_row.tolist())
            if num_blocks
        ]

    def take_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, columns) [N] int64 of the entries written since the last call, each once,
        and a fresh record. The entries' values are the table's now."""
        if self.changed_spans is None:
            raise ValueError("take_changes on a block table whose changes are not tracked")
        spans, self.changed_spans = self.changed_spans, []
        if not spans:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        width = self.max_num_blocks_per_req
        flat = np.concatenate(
            [np.arange(row * width + start, row * width + end) for row, start, end in spans]
        )
        rows, columns = np.divmod(np.unique(flat), width)
        return rows, columns

    def _record(self, row_idx: int, start: int, end: int) -> None:
        if self.changed_spans is not None and end > start:
            self.changed_spans.append((row_idx, start, end))

    def row(self, row_idx: int) -> np.ndarray:
        """The block ids row `row_idx` holds (a view)."""
        return self.block_table[row_idx, : self.num_blocks_per_row[row_idx]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot of each (row, position): block_id * block_size + position % block_size.

        block_id = block_table[row, position // block_size].

        Raises ValueError when a position lies past the blocks its row holds.
        """
        block_idx = positions // self.block_size
        if len(positions) and (block_idx >= self.num_blocks_per_row[req_indices]).any():
            bad = int(np.argmax(block_idx >= self.num_blocks_per_row[req_indices]))
            row = int(req_indices[bad])
            raise ValueError(
                f"position {int(positions[bad])} of row {row} needs block {int(block_idx[bad])}, "
                f"but the row holds {int(self.num_blocks_per_row[row])} blocks"
            )
        block_ids = self.block_table[req_indices, block_idx].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size

    def check_invariants(self) -> None:
        """Walk every row: shapes, block counts in range, no negative id, zeros past the count."""
        table, counts = self.block_table, self.num_blocks_per_row
        expected = (len(counts), self.max_num_blocks_per_req)
        assert table.shape == expected and table.dtype == np.int32, (
            f"block_table is {table.dtype} {table.shape}, expected int32 {expected}"
        )
        assert counts.dtype == np.int32, f"num_blocks_per_row is {counts.dtype}, expected int32"
        bad_rows = np.flatnonzero((counts < 0) | (counts > self.max_num_blocks_per_req))
        assert not len(bad_rows), (
            f"row {int(bad_rows[0])} holds {int(counts[bad_rows[0]])} blocks, expected 0 to "
            f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
        )
        beyond = np.arange(self.max_num_blocks_per_req)[None, :] >= counts[:, None]
        for mask, what in ((beyond & (table != 0), "past its block count"), (table < 0, "< 0")):
            rows, cols = np.nonzero(mask)
            assert not len(rows), (
                f"row {int(rows[0])} holds block id {int(table[rows[0], cols[0]])} at index "
                f"{int(cols[0])}, {what}: the row holds {int(counts[rows[0]])} blocks"
            )


class MultiGroupBlockTable:
    """One BlockTable per KV-cache group, whose rows move together.

    Invariants: every table has the same max_num_reqs; each satisfies its own invariants.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_sizes: list[int]) -> None:
        self.tables = [
            BlockTable(max_num_reqs, cdiv(max_model_len, block_size), block_size)
            for block_size in block_sizes
        ]

    def __getitem__(self, group_idx: int) -> BlockTable:
        return self.tables[group_idx]

    def __len__(self) -> int:
        return len(self.tables)

    def grow(self, max_num_reqs: int) -> None:
        for table in self.tables:
            table.grow(max_num_reqs)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_num_groups(block_ids)
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_num_groups(block_ids)
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        for table in self.tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.tables:
            table.move_row(src, tgt)

    def check_invariants(self) -> None:
        sizes = {table.max_num_reqs for table in self.tables}
        assert len(sizes) <= 1, f"group tables disagree on max_num_reqs: {sorted(sizes)}"
        for table in self.tables:
            table.check_invariants()

    def _check_num_groups(self, block_ids: tuple[list[int], ...]) -> None:
        if len(block_ids) != len(self.tables):
            raise ValueError(
                f"got block ids for {len(block_ids)} KV-cache groups, expected {len(self.tables)}"
            )
