"""The worker's side of the Mamba protocol (worker/mamba_state.py): each request's starting and
ending state blocks follow the engine's rule for the mode through its table, a state where the
table has none or the null block is refused, and the state caches are per-rank views of the
shared tensors.
"""

import numpy as np
import pytest
import torch

from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from worker.attention import StepLayout
from worker.block_table import BlockTable
from worker.kv_cache import allocate_kv_caches, layer_page_shape
from worker.mamba_state import state_blocks, state_position

BLOCK_SIZE = 4
ALIGN = MambaSpec(BLOCK_SIZE, ((4, 3),), "float32", mamba_cache_mode="align")
NONE = MambaSpec(BLOCK_SIZE, ((4, 3),), "float32", mamba_cache_mode="none")


def layout(first_positions: list[int], num_queries: list[int]) -> StepLayout:
    counts = np.array(num_queries, dtype=np.int64)
    return StepLayout(
        rows=np.arange(len(counts), dtype=np.int64),
        first_positions=np.array(first_positions, dtype=np.int64),
        num_queries=counts,
        token_offsets=np.cumsum(counts) - counts,
        logits_reqs=np.arange(len(counts)),
        num_prompt_tokens=counts,
    )


def table_of(rows: list[list[int]]) -> BlockTable:
    table = BlockTable(len(rows), 8, BLOCK_SIZE)
    for row_idx, block_ids in enumerate(rows):
        table.add_row(block_ids, row_idx)
    return table


def test_align_positions_follow_the_engine_and_one_block_tables_stay_at_zero() -> None:
    assert [state_position(ALIGN, 3, t) for t in (1, 4, 5, 8, 9, 12)] == [0, 0, 1, 1, 2, 2]
    # Without a prefix cache the engine runs an align group as one block (mamba_manager.py).
    assert [state_position(ALIGN, 1, t) for t in (1, 4, 5, 40)] == [0, 0, 0, 0]
    assert [state_position(NONE, 1, t) for t in (1, 5, 40)] == [0, 0, 0]


def test_a_step_loads_from_its_last_checkpoint_and_stores_at_its_end() -> None:
    """Row 0 resumes a hit at 8 (null, checkpoint 7) and runs to 10; row 1 decodes in place
    from 5 to 6; row 2 is a new prompt of 3 tokens, whose state starts at zero."""
    table = table_of([[0, 7, 9], [0, 5], [6]])
    blocks = state_blocks(ALIGN, table, layout([8, 5, 0], [2, 1, 3]), torch.device("cpu"))
    assert blocks.load_block_ids.tolist()[:2] == [7, 5]
    assert blocks.has_start.tolist() == [True, True, False]
    assert blocks.store_block_ids.tolist() == [9, 5, 6]


@pytest.mark.parametrize(
    ("rows", "first", "count", "message"),
    [
        ([[0, 0, 9]], 8, 2, "null block at state position 1"),  # a lost checkpoint
        ([[0, 7]], 8, 2, "needs its state at table position 2 but holds 2"),
        ([[3], [3]], 0, 2, "store their states into blocks"),
    ],
    ids=["null-start", "short-table", "shared-store"],
)
def test_a_state_the_table_cannot_give_is_refused(
    rows: list[list[int]], first: int, count: int, message: str
) -> None:
    step = layout([first] * len(rows), [count] * len(rows))
    with pytest.raises(ValueError, match=message):
        state_blocks(ALIGN, table_of(rows), step, torch.device("cpu"))


def test_mode_none_refuses_a_table_of_more_than_one_block() -> None:
    with pytest.raises(ValueError, match="holds 2 blocks in a Mamba group of mode none"):
        state_blocks(NONE, table_of([[3, 4]]), layout([4], [1]), torch.device("cpu"))


def test_state_caches_are_per_rank_views_of_the_shared_tensors() -> None:
    spec = MambaSpec(BLOCK_SIZE, ((4, 3),), "float64", mamba_cache_mode="align")
    groups = [
        KVCacheGroupSpec(["attn.0", "attn.1"], FullAttentionSpec(BLOCK_SIZE, 2, 4, "float32")),
        KVCacheGroupSpec(["mamba.0", "mamba.1"], spec),
    ]
    assert layer_page_shape(spec, 2) == (2, 3)
    caches = allocate_kv_caches(KVCacheConfig(5, groups), 2, torch.device("cpu"))
    assert caches["mamba.1"].shape == (5, 2, 3) and caches["mamba.1"].dtype == torch.float64
    caches["mamba.1"][2] = 1.0
    shared = caches["attn.1"]
    assert shared.untyped_storage().data_ptr() == caches["mamba.1"].untyped_storage().data_ptr()
    assert shared[2].any() and not caches["mamba.0"].any()
    with pytest.raises(ValueError, match="not divisible by tp_size=3"):
        layer_page_shape(spec, 3)
