"""BlockTable row operations and slot mapping, against a list-of-lists model and a naive loop."""

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worker.block_table import BlockTable, MultiGroupBlockTable

MAX_ROWS = 4
MAX_BLOCKS = 5
BLOCK_SIZE = 4


def naive_slot_mapping(
    rows: list[list[int]], req_indices: list[int], positions: list[int]
) -> list[int]:
    slots = []
    for row, pos in zip(req_indices, positions, strict=True):
        slots.append(rows[row][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    return slots


class BlockTableMachine(RuleBasedStateMachine):
    """Random row operations applied to a BlockTable and to a plain list-of-lists reference, and
    a mirror of the table (as the device's copy in worker/step_buffers.py) that learns only the
    entries `take_changes` names."""

    def __init__(self) -> None:
        super().__init__()
        self.table = BlockTable(MAX_ROWS, MAX_BLOCKS, BLOCK_SIZE)
        self.rows: list[list[int]] = [[] for _ in range(MAX_ROWS)]
        self.table.track_changes()
        self.mirror = np.zeros((MAX_ROWS, MAX_BLOCKS), dtype=np.int32)

    ids = st.lists(st.integers(1, 50), max_size=MAX_BLOCKS)
    row_idx = st.integers(0, MAX_ROWS - 1)

    @rule(block_ids=ids, row=row_idx)
    def add_row(self, block_ids: list[int], row: int) -> None:
        self.table.add_row(block_ids, row)
        self.rows[row] = list(block_ids)

    @rule(block_ids=ids, row=row_idx)
    def append_row(self, block_ids: list[int], row: int) -> None:
        if len(self.rows[row]) + len(block_ids) > MAX_BLOCKS:
            with pytest.raises(ValueError, match="more than max_num_blocks_per_req"):
                self.table.append_row(block_ids, row)
            return
        self.table.append_row(block_ids, row)
        self.rows[row].extend(block_ids)

    @rule(src=row_idx, tgt=row_idx)
    def move_row(self, src: int, tgt: int) -> None:
        self.table.move_row(src, tgt)
        if src != tgt:
            self.rows[tgt], self.rows[src] = self.rows[src], []

    @rule(row=row_idx)
    def clear_row(self, row: int) -> None:
        self.table.clear_row(row)
        self.rows[row] = []

    @precondition(lambda self: any(self.rows))
    @rule(data=st.data())
    def slot_mapping_matches_naive_loop(self, data: st.DataObject) -> None:
        live = [r for r in range(MAX_ROWS) if self.rows[r]]
        pairs = data.draw(
            st.lists(
                st.sampled_from(live).flatmap(
                    lambda r: st.tuples(
                        st.just(r), st.integers(0, len(self.rows[r]) * BLOCK_SIZE - 1)
                    )
                ),
                min_size=1,
                max_size=12,
            )
        )
        req_indices = [r for r, _ in pairs]
        positions = [p for _, p in pairs]
        got = self.table.compute_slot_mapping(np.array(req_indices), np.array(positions))
        assert got.tolist() == naive_slot_mapping(self.rows, req_indices, positions)

    @rule()
    def mirror_takes_the_changes(self) -> None:
        rows, columns = self.table.take_changes()
        entries = list(zip(rows.tolist(), columns.tolist(), strict=True))
        assert len(set(entries)) == len(entries), f"an entry named twice in {entries}"
        self.mirror[rows, columns] = self.table.block_table[rows, columns]
        assert np.array_equal(self.mirror, self.table.block_table)

    @invariant()
    def rows_match_reference(self) -> None:
        self.table.check_invariants()
        for r in range(MAX_ROWS):
            assert self.table.row(r).tolist() == self.rows[r]


TestBlockTableMachine = BlockTableMachine.TestCase


def test_slot_mapping_rejects_a_position_past_the_row() -> None:
    table = BlockTable(2, 4, BLOCK_SIZE)
    table.add_row([7, 3], 0)
    assert table.compute_slot_mapping(np.array([0, 0]), np.array([0, 7])).tolist() == [28, 15]
    with pytest.raises(ValueError, match="needs block 2, but the row holds 2 blocks"):
        table.compute_slot_mapping(np.array([0]), np.array([8]))


def _changed_entries(table: BlockTable) -> list[tuple[int, int]]:
    rows, columns = table.take_changes()
    return list(zip(rows.tolist(), columns.tolist(), strict=True))


def test_tracking_started_late_names_the_blocks_rows_already_hold() -> None:
    table = BlockTable(3, 4, BLOCK_SIZE)
    table.add_row([7, 3], 1)
    with pytest.raises(ValueError, match="not tracked"):
        table.take_changes()
    table.track_changes()
    assert _changed_entries(table) == [(1, 0), (1, 1)]
    table.move_row(1, 0)  # row 0 gets [7, 3]; row 1 is cleared
    assert _changed_entries(table) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _changed_entries(table) == []


def test_grow_keeps_rows() -> None:
    table = BlockTable(1, 3, BLOCK_SIZE)
    table.add_row([5, 6], 0)
    table.grow(4)
    table.add_row([9], 3)
    table.check_invariants()
    assert table.max_num_reqs == 4
    assert table.row(0).tolist() == [5, 6] and table.row(3).tolist() == [9]


def test_move_row_clears_the_source() -> None:
    table = BlockTable(3, 3, BLOCK_SIZE)
    table.add_row([1, 2, 3], 0)
    table.add_row([4], 2)
    table.move_row(2, 0)
    table.check_invariants()
    assert table.row(0).tolist() == [4] and table.row(2).tolist() == []


def test_multi_group_table_moves_every_group_and_checks_group_count() -> None:
    tables = MultiGroupBlockTable(2, max_model_len=16, block_sizes=[4, 4])
    tables.add_row(([1, 2], [3]), 0)
    tables.move_row(0, 1)
    tables.check_invariants()
    assert tables[0].row(1).tolist() == [1, 2] and tables[1].row(1).tolist() == [3]
    with pytest.raises(ValueError, match="block ids for 1 KV-cache groups, expected 2"):
        tables.append_row(([5],), 1)


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        BlockTable(0, 4, 4)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda t: t.block_table.__setitem__((0, 3), 9), "block id 9 at index 3, past its block"),
        (lambda t: t.block_table.__setitem__((1, 0), -2), "block id -2 at index 0, < 0"),
        (lambda t: t.num_blocks_per_row.__setitem__(1, 5), "row 1 holds 5 blocks, expected 0 to"),
        (lambda t: t.num_blocks_per_row.__setitem__(0, -1), "row 0 holds -1 blocks"),
    ],
)
def test_check_invariants_catches_a_planted_corruption(
    corrupt: Callable[[BlockTable], None], message: str
) -> None:
    table = BlockTable(2, 4, BLOCK_SIZE)
    table.add_row([7, 3], 0)
    table.add_row([5], 1)
    table.check_invariants()
    corrupt(table)
    with pytest.raises(AssertionError, match=message):
        table.check_invariants()


def test_multi_group_check_invariants_walks_every_group() -> None:
    tables = MultiGroupBlockTable(2, max_model_len=16, block_sizes=[4, 4])
    tables.add_row(([1, 2], [3]), 0)
    tables[1].block_table[0, 2] = 6
    with pytest.raises(AssertionError, match="block id 6 at index 2, past its block count"):
        tables.check_invariants()
