"""InputBatch: the persistent rows of the requests a worker is running, kept compact.

Each row holds a request's token ids, sampling params (also as columns, worker/sampling/columns.py)
and (through the block tables) its block ids. A request that leaves moves the last row into its
hole. No torch, no model, no I/O.
"""

from dataclasses import dataclass

import numpy as np

from protocol.sampling import SamplingParams
from worker.block_table import MultiGroupBlockTable
from worker.sampling.columns import SamplingTable

INITIAL_MAX_NUM_REQS = 16  # rows double when full


@dataclass(slots=True, eq=False)
class ParkedRequest:
    """A preempted request: it keeps its tokens and params until a later step resumes it."""

    token_ids: np.ndarray  # [num_tokens] int32
    sampling_params: SamplingParams
    num_prompt_tokens: int | None = None  # leading token_ids that came with it; None: all of them


class InputBatch:
    """The running requests, one row each, rows 0..num_reqs-1 in use.

    Invariants:
    - `handle_to_row` and `handles[:num_reqs]` are inverse maps; rows past num_reqs hold no request.
    - 0 < num_tokens[row] <= max_model_len for live rows, 0 for the others.
    - 0 < num_prompt_tokens[row] <= num_tokens[row] for live rows, 0 for the others: the engine's
      num_prompt_tokens of the request, which R-SWA layers keep reading while they decode.
    - the block tables and the sampling table have as many rows as the token array, and the
      sampling table counts the live rows' sampling params.
    """

    def __init__(self, max_model_len: int, block_sizes: list[int]) -> None:
        self.max_model_len = max_model_len
        rows = INITIAL_MAX_NUM_REQS
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)  # [rows, max_model_len]
        self.num_tokens = np.zeros(rows, dtype=np.int32)  # [rows]
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int32)  # [rows]
        self.handles: list[int | None] = [None] * rows
        self.sampling_params: list[SamplingParams | None] = [None] * rows
        self.handle_to_row: dict[int, int] = {}
        self.block_table = MultiGroupBlockTable(rows, max_model_len, block_sizes)
        self.sampling = SamplingTable(rows)

    @property
    def num_reqs(self) -> int:
        return len(self.handle_to_row)

    def add_request(
        self,
        handle: int,
        token_ids: np.ndarray,
        sampling_params: SamplingParams,
        block_ids: tuple[list[int], ...],
        num_prompt_tokens: int | None = None,  # leading token_ids that are its prompt; None: all
    ) -> int:
        """Give `handle` the next free row and return it."""
        if handle in self.handle_to_row:
            raise ValueError(f"request {handle} already has row {self.handle_to_row[handle]}")
        if num_prompt_tokens is None:
            num_prompt_tokens = len(token_ids)
        if not 0 < num_prompt_tokens <= len(token_ids):
            raise ValueError(
                f"request {handle} has a {num_prompt_tokens}-token prompt, expected 1 to its "
                f"{len(token_ids)} tokens"
            )
        row = self.num_reqs
        if row == len(self.handles):
            self._grow(2 * row)
        self.handle_to_row[handle] = row
        self.handles[row] = handle
        self.sampling_params[row] = sampling_params
        self.sampling.add_row(row, sampling_params)
        self.num_tokens[row] = 0
        self.append_token_ids(row, token_ids)
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.block_table.add_row(block_ids, row)
        return row

    def remove_request(self, handle: int) -> ParkedRequest:
        """Free the row of `handle`, moving the last row into it, and return what the row held."""
        row = self.handle_to_row.pop(handle)
        parked = ParkedRequest(
            self.token_ids[row, : self.num_tokens[row]].copy(),
            self.sampling_params[row],
            int(self.num_prompt_tokens[row]),
        )
        self.sampling.remove_row(row, parked.sampling_params)
        last = self.num_reqs  # the row count after the pop
        if row != last:
            self._move_row(last, row)
        self.handles[last] = None
        self.sampling_params[last] = None
        self.num_tokens[last] = 0
        self.num_prompt_tokens[last] = 0
        self.block_table.clear_row(last)
        return parked

    def append_token_ids(self, row: int, token_ids: np.ndarray) -> None:
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"request {self.handles[row]} would hold {end} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of `rows` (distinct rows, int64). A row already at
        max_model_len keeps its tokens: the engine ends that request at its length cap."""
        ends = self.num_tokens[rows]
        has_room = ends < self.max_model_len
        if not has_room.all():
            rows, token_ids, ends = rows[has_room], token_ids[has_room], ends[has_room]
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1

    def _move_row(self, src: int, tgt: int) -> None:
        num_tokens = int(self.num_tokens[src])
        self.token_ids[tgt, :num_tokens] = self.token_ids[src, :num_tokens]
        self.num_tokens[tgt] = num_tokens
        self.num_prompt_tokens[tgt] = self.num_prompt_tokens[src]
        self.handles[tgt] = self.handles[src]
        self.sampling_params[tgt] = self.sampling_params[src]
        self.sampling.move_row(src, tgt)
        self.handle_to_row[self.handles[tgt]] = tgt
        self.block_table.move_row(src, tgt)

    def _grow(self, rows: int) -> None:
        extra = rows - len(self.handles)
        # [rows, max_model_len] and [rows]: old rows first, then zeros
        self.token_ids = np.vstack(
            (self.token_ids, np.zeros((extra, self.max_model_len), dtype=np.int32))
        )
        self.num_tokens = np.concatenate((self.num_tokens, np.zeros(extra, dtype=np.int32)))
        self.num_prompt_tokens = np.concatenate(
            (self.num_prompt_tokens, np.zeros(extra, dtype=np.int32))
        )
        self.handles.extend([None] * extra)
        self.sampling_params.extend([None] * extra)
        self.sampling.grow(rows)
        self.block_table.grow(rows)

    def check_invariants(self) -> None:
        num_reqs = self.num_reqs
        for handle, row in self.handle_to_row.items():
            assert row < num_reqs, f"request {handle} sits at row {row} past num_reqs={num_reqs}"
            assert self.handles[row] == handle, f"row {row} names {self.handles[row]}, not {handle}"
            assert 0 < self.num_tokens[row] <= self.max_model_len, (
                f"request {handle} holds {self.num_tokens[row]} tokens"
            )
            assert 0 < self.num_prompt_tokens[row] <= self.num_tokens[row], (
                f"request {handle} has a {self.num_prompt_tokens[row]}-token prompt in "
                f"{self.num_tokens[row]} tokens"
            )
        free_rows = range(num_reqs, len(self.handles))
        assert all(self.handles[row] is None for row in free_rows), "a free row names a request"
        assert not self.num_tokens[num_reqs:].any(), "a free row holds tokens"
        assert not self.num_prompt_tokens[num_reqs:].any(), "a free row has a prompt length"
        for table in self.block_table.tables:
            assert table.max_num_reqs == len(self.handles), (
                f"block table has {table.max_num_reqs} rows, batch has {len(self.handles)}"
            )
        self.block_table.check_invariants()
        assert len(self.sampling.temperature) == len(self.handles), (
            f"sampling table has {len(self.sampling.temperature)} rows, batch has "
            f"{len(self.handles)}"
        )
        live = [self.sampling_params[row] for row in range(num_reqs)]
        assert all(params is not None for params in live), "a live row has no sampling params"
        self.sampling.check_invariants([params for params in live if params is not None])
