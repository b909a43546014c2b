"""Recurrent (Mamba) states in the paged pool: which block each scheduled request starts its step
from and which one it leaves its state in, read only through the request's block table; and the
unpaged store the reference model uses instead. It never decides which blocks a request holds.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from protocol.kv_cache_spec import NULL_BLOCK_ID, MambaSpec, cdiv
from worker.attention import PagedKV, StepLayout
from worker.block_table import BlockTable


class MambaStateContext(Protocol):
    """What a recurrent layer needs of a state store: PagedMambaState here, DenseMambaState
    unpaged. Every load of a step comes before its stores, as in a batched kernel."""

    def token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """([R] index of each request's first token in the step, [R] its token count)."""
        ...

    def load_states(self, layer_name: str) -> torch.Tensor:
        """[R, *state_shape_per_rank] float64: each request's state before its first token."""
        ...

    def store_states(self, layer_name: str, states: torch.Tensor) -> None:
        """Keep [R, *state_shape_per_rank]: each request's state after its last token."""
        ...


def state_position(spec: MambaSpec, num_table_blocks: int, num_tokens: int) -> int:
    """The table position of a request's state after `num_tokens` (>= 1) tokens.

    In "align" mode the state after t tokens sits at cdiv(t, block_size) - 1, the engine's rule
    (engine_core/kv_cache/mamba_manager.py). The engine runs an "align" group as one block
    updated in place when prefix caching is off, and workers are not told whether it is on; a
    one-block table tells them: an align table holds cdiv(t, block_size) positions once a step
    has its blocks, so a single position means t <= block_size, where both rules say 0.
    """
    if spec.mamba_cache_mode == "align" and num_table_blocks > 1:
        return cdiv(num_tokens, spec.block_size) - 1
    return 0


@dataclass(frozen=True, slots=True)
class StateBlocks:
    """One step's state blocks of one Mamba group, one entry per scheduled request."""

    load_block_ids: torch.Tensor  # [R] block of the starting state; the null block where none
    has_start: torch.Tensor  # [R] bool: False for a request at token 0, whose state starts at zero
    store_block_ids: torch.Tensor  # [R] block that receives the state after the step


def state_blocks(
    spec: MambaSpec, table: BlockTable, layout: StepLayout, device: torch.device
) -> StateBlocks:
    """Each scheduled request's starting and ending state blocks, through its table row.

    Raises ValueError where a state must be but the table has none or the null block, or when two
    requests would store into one block.
    """
    rows = layout.rows
    starts = layout.first_positions
    ends = starts + layout.num_queries
    num_held = table.num_blocks_per_row[rows].astype(np.int64)
    if spec.mamba_cache_mode == "none" and (num_held != 1).any():
        bad = int(np.argmax(num_held != 1))
        raise ValueError(
            f"row {int(rows[bad])} holds {int(num_held[bad])} blocks in a Mamba group of mode "
            f"none: expected its one state block"
        )
    load_ids = np.full(len(rows), NULL_BLOCK_ID, dtype=np.int64)
    store_ids = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows.tolist()):
        held = int(num_held[i])
        store_ids[i] = _state_block(table, row, held, state_position(spec, held, int(ends[i])))
        if starts[i] > 0:
            load_ids[i] = _state_block(table, row, held, state_position(spec, held, int(starts[i])))
    if len(np.unique(store_ids)) != len(store_ids):
        raise ValueError(f"rows {rows.tolist()} would store their states into blocks {store_ids}")
    return StateBlocks(
        torch.from_numpy(load_ids).to(device),
        torch.from_numpy(starts > 0).to(device),
        torch.from_numpy(store_ids).to(device),
    )


def _state_block(table: BlockTable, row: int, num_held: int, position: int) -> int:
    if position >= num_held:
        raise ValueError(
            f"row {row} needs its state at table position {position} but holds {num_held} blocks"
        )
    block_id = int(table.block_table[row, position])
    if block_id == NULL_BLOCK_ID:
        raise ValueError(f"row {row} has the null block at state position {position}")
    return block_id


class PagedMambaState:
    """The Mamba groups' state caches `[num_blocks, *state_shape_per_rank]` as one step sees them.

    It borrows the step's tables and layout from PagedKV and is built for one step; each group's
    blocks are found once and reused by its layers.
    """

    def __init__(self, paged: PagedKV) -> None:
        self.paged = paged
        self._blocks: dict[int, StateBlocks] = {}

    def token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        return self.paged.layout.token_offsets, self.paged.layout.num_queries

    def load_states(self, layer_name: str) -> torch.Tensor:
        blocks = self._group_blocks(layer_name)
        states = self.paged.kv_caches[layer_name].index_select(0, blocks.load_block_ids)
        mask = blocks.has_start.view(-1, *[1] * (states.dim() - 1))
        return torch.where(mask, states.double(), 0.0)

    def store_states(self, layer_name: str, states: torch.Tensor) -> None:
        cache = self.paged.kv_caches[layer_name]
        cache.index_copy_(0, self._group_blocks(layer_name).store_block_ids, states.to(cache.dtype))

    def _group_blocks(self, layer_name: str) -> StateBlocks:
        paged = self.paged
        group_idx = paged.layer_to_group[layer_name]
        if group_idx not in self._blocks:
            spec = paged.specs[group_idx]
            if not isinstance(spec, MambaSpec):
                raise TypeError(f"layer {layer_name} is in a {type(spec).__name__} group")
            table = paged.tables[group_idx]
            self._blocks[group_idx] = state_blocks(spec, table, paged.layout, paged.device)
        return self._blocks[group_idx]


class DenseMambaState:
    """One whole sequence as a single request whose state starts at zero; stores are kept for
    inspection and never read back. No blocks."""

    def __init__(self, num_tokens: int, state_shape: tuple[int, ...], device: torch.device) -> None:
        self.num_tokens = num_tokens
        self.state_shape = state_shape
        self.device = device
        self.store: dict[str, torch.Tensor] = {}

    def token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(1, dtype=np.int64), np.array([self.num_tokens], dtype=np.int64)

    def load_states(self, layer_name: str) -> torch.Tensor:
        return torch.zeros((1, *self.state_shape), dtype=torch.float64, device=self.device)

    def store_states(self, layer_name: str, states: torch.Tensor) -> None:
        self.store[layer_name] = states
