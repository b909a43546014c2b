"""StepBuffers: the columns of a step (padding rules included), the device block tables kept by
new entries alone, and, under the engine's own Scheduler with new, finished, preempted and resumed
requests, exactly the inputs the eager preparation (PagedKV) gives every step."""

import itertools

import numpy as np
import pytest
import torch
from model_workloads import reference, workload

from bench.workload import build_rank, run_to_completion
from protocol.kv_cache_spec import KVCacheConfig
from worker.attention import PagedKV, StepLayout
from worker.block_table import MultiGroupBlockTable
from worker.distributed import single_rank_group
from worker.kv_cache import allocate_kv_caches
from worker.models.model import Model
from worker.models.registry import get_model_info
from worker.step_buffers import (
    COLUMNS,
    NO_SLOT,
    DeviceStep,
    StepBuffers,
    StepLimits,
    column_slices,
    is_decode_only,
    step_columns,
)

CPU = torch.device("cpu")
NUM_PADDED = 3  # requests each decode-only step is also staged with, as a graph would pad it

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def layout(rows: list[int], first: list[int], counts: list[int], sampled: list[int]) -> StepLayout:
    counts_array, first_array = np.array(counts, np.int64), np.array(first, np.int64)
    return StepLayout(
        rows=np.array(rows, np.int64),
        first_positions=first_array,
        num_queries=counts_array,
        token_offsets=np.cumsum(counts_array) - counts_array,
        logits_reqs=np.array(sampled, np.int64),
        num_prompt_tokens=first_array + counts_array,
    )


def test_columns_of_a_mixed_step() -> None:
    """Row 2 decodes, row 0 prefills a chunk short of its end (not sampled), row 1 decodes."""
    step = layout(rows=[2, 0, 1], first=[5, 0, 9], counts=[1, 3, 1], sampled=[0, 2])
    columns = step_columns(step, np.array([40, 41, 42, 43, 44]), np.array([5, 0, 1, 2, 9]))
    assert not is_decode_only(step)
    assert columns.token_rows.tolist() == [2, 0, 0, 0, 1]
    assert columns.req_rows.tolist() == [2, 0, 1]
    assert columns.seq_lens.tolist() == [6, 3, 10]
    assert columns.query_start_loc.tolist() == [0, 1, 4, 5]
    assert columns.logits_idx.tolist() == [0, 4]
    assert columns.logits_rows.tolist() == [2, 1]
    assert columns.logits_seq_lens.tolist() == [6, 10]
    assert columns.logits_query_start_loc.tolist() == [0, 1, 2]
    assert (columns.max_query_len, columns.max_seq_len) == (3, 10)
    with pytest.raises(ValueError, match="only a decode-only step is padded"):
        step_columns(step, np.arange(5), np.arange(5), num_padded_reqs=1)


def test_padded_requests_own_no_query_read_nothing_and_write_no_slot() -> None:
    step = layout(rows=[1, 0], first=[4, 7], counts=[1, 1], sampled=[0, 1])
    assert is_decode_only(step)
    columns = step_columns(step, np.array([30, 31]), np.array([4, 7]), num_padded_reqs=2)
    assert columns.token_ids.tolist() == [30, 31, 0, 0]
    assert columns.positions.tolist() == [4, 7, 0, 0]
    assert columns.token_rows.tolist() == [1, 0, -1, -1]  # -1: no slot
    assert columns.req_rows.tolist() == [1, 0, 0, 0]
    assert columns.seq_lens.tolist() == [5, 8, 0, 0]  # no context
    assert columns.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # no query
    assert columns.logits_idx.tolist() == [0, 1, 2, 3]  # their rows are dropped after
    assert columns.logits_seq_lens.tolist() == [5, 8, 0, 0]
    assert columns.logits_query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert columns.max_query_len == 1
    no_tokens = np.zeros(0, np.int64)
    only_padding = step_columns(layout([], [], [], []), no_tokens, no_tokens, 2)
    assert only_padding.max_query_len == 1 and only_padding.query_start_loc.tolist() == [0, 0, 0]


def test_columns_sit_back_to_back_at_addresses_fixed_by_the_shape() -> None:
    step = layout(rows=[0, 1], first=[3, 0], counts=[1, 4], sampled=[0, 1])
    shape = step_columns(step, np.arange(5), np.arange(5)).shape
    slices = column_slices(shape)
    assert list(slices) == list(COLUMNS)
    lengths = [part.stop - part.start for part in slices.values()]
    assert lengths == [5, 5, 5, 2, 2, 3, 2, 2, 2, 3]
    parts = list(slices.values())
    assert parts[0].start == 0 and all(a.stop == b.start for a, b in itertools.pairwise(parts))
    other = step_columns(layout([1, 0], [8, 2], [2, 3], [0, 1]), np.arange(5), np.arange(5))
    assert column_slices(other.shape) == slices  # same counts, same addresses


def buffers_of(tables: MultiGroupBlockTable, model: str, num_reqs: int) -> StepBuffers:
    info = get_model_info(model, tables[0].block_size)
    config = KVCacheConfig(8, info.kv_cache_groups)
    kv_caches = allocate_kv_caches(config, 1, CPU)
    return StepBuffers(tables, config, kv_caches, StepLimits(32, num_reqs), CPU)


def test_device_tables_take_only_the_written_entries_and_refuse_rows_past_their_own() -> None:
    tables = MultiGroupBlockTable(4, max_model_len=32, block_sizes=[4])
    tables.add_row(([3, 5],), 0)  # before the buffers exist: their first stage copies it
    buffers = buffers_of(tables, "tiny-llama", num_reqs=2)
    tables.add_row(([7],), 1)
    buffers.stage(layout([0, 1], [7, 2], [1, 1], [0, 1]), np.array([9, 9]), np.array([7, 2]))
    buffers.check_invariants()
    assert buffers.block_tables[0, :2, :3].tolist() == [[3, 5, 0], [7, 0, 0]]
    tables.append_row(([6],), 1)
    tables.move_row(1, 0)  # as a finished request's hole is filled
    buffers.stage(layout([0], [4], [1], [0]), np.array([9]), np.array([4]))
    buffers.check_invariants()
    assert buffers.block_tables[0, :2, :3].tolist() == [[7, 6, 0], [0, 0, 0]]
    tables.add_row(([2],), 2)
    with pytest.raises(ValueError, match="wrote row 2, but the device holds max_num_reqs=2"):
        buffers.stage(layout([0], [4], [1], [0]), np.array([9]), np.array([4]))


def test_a_padded_decode_step_maps_its_padding_to_no_slot() -> None:
    tables = MultiGroupBlockTable(4, max_model_len=32, block_sizes=[4])
    tables.add_row(([3, 5],), 0)
    buffers = buffers_of(tables, "tiny-llama", num_reqs=4)
    shape = buffers.stage(layout([0], [6], [1], [0]), np.array([9]), np.array([6]), 3)
    step = buffers.device_step(shape)
    assert step.slot_mappings[0].tolist() == [5 * 4 + 2, NO_SLOT, NO_SLOT, NO_SLOT]
    assert step.attention[0].query_start_loc.tolist() == [0, 1, 1, 1, 1]
    assert step.logits_attention[0].seq_lens.tolist() == [7, 0, 0, 0]


class BufferCheckingModel:
    """Stands in front of a runner's model: each step it stages the runner's step into
    StepBuffers over the runner's own block tables, checks every input a DeviceStep holds
    against the PagedKV the runner built, then runs the model on the PagedKV."""

    def __init__(self, model: Model, buffers: StepBuffers) -> None:
        self.model = model
        self.buffers = buffers
        self.vocab_size = model.vocab_size
        self.num_steps, self.num_padded_steps = 0, 0

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: PagedKV,
    ) -> torch.Tensor:
        step_layout, buffers = kv.layout, self.buffers
        shape = buffers.stage(step_layout, token_ids.numpy(), positions.numpy())
        buffers.check_invariants()
        self.check(buffers.device_step(shape), token_ids, positions, logits_idx, kv)
        self.num_steps += 1
        if is_decode_only(step_layout):
            num_reqs = len(step_layout.rows)
            shape = buffers.stage(step_layout, token_ids.numpy(), positions.numpy(), NUM_PADDED)
            padded = buffers.device_step(shape)
            self.check_padding(padded, num_reqs)
            self.num_padded_steps += 1
        return self.model.forward(token_ids, positions, logits_idx, kv)

    def check(
        self,
        step: DeviceStep,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: PagedKV,
    ) -> None:
        assert torch.equal(step.token_ids, token_ids)
        assert torch.equal(step.positions, positions)
        assert torch.equal(step.logits_idx, logits_idx)
        step_layout = kv.layout
        seq_lens = step_layout.first_positions + step_layout.num_queries
        starts = np.concatenate(([0], np.cumsum(step_layout.num_queries)))
        sampled = step_layout.logits_reqs
        for group_idx, table in enumerate(kv.tables.tables):
            block_idx, offsets = kv.write_indices[group_idx]
            slots = block_idx * table.block_size + offsets
            assert torch.equal(step.slot_mappings[group_idx], slots), f"group {group_idx}"
            width = table.max_num_blocks_per_req
            for inputs, reqs in (
                (step.attention[group_idx], np.arange(len(step_layout.rows))),
                (step.logits_attention[group_idx], sampled),
            ):
                rows = step_layout.rows[reqs]
                block_table = inputs.block_table.numpy()
                assert np.array_equal(block_table[:, :width], table.block_table[rows])
                assert not block_table[:, width:].any()
                assert inputs.seq_lens.tolist() == seq_lens[reqs].tolist()
            assert step.attention[group_idx].query_start_loc.tolist() == starts.tolist()
            logits_starts = step.logits_attention[group_idx].query_start_loc.tolist()
            assert logits_starts == list(range(len(sampled) + 1))

    def check_padding(self, padded: DeviceStep, num_reqs: int) -> None:
        for slot_mapping in padded.slot_mappings:
            assert slot_mapping[num_reqs:].tolist() == [NO_SLOT] * NUM_PADDED
        for inputs in (*padded.attention, *padded.logits_attention):
            assert inputs.seq_lens[num_reqs:].tolist() == [0] * NUM_PADDED
            assert inputs.query_start_loc[num_reqs:].tolist() == [num_reqs] * (NUM_PADDED + 1)


@pytest.mark.parametrize(
    ("model", "block_size", "num_blocks", "max_num_batched_tokens"),
    [("tiny-llama", 16, 9, 32), ("tiny-llama-hybrid-2x", 4, 36, 24)],
    ids=["full-attention", "window-group-of-twice-the-block-size"],
)
def test_step_buffers_give_the_eager_inputs_through_preemption_and_resumption(
    model: str, block_size: int, num_blocks: int, max_num_batched_tokens: int
) -> None:
    """Pools too small for the batch (test_models_paged_vs_reference.py's): requests are
    preempted and resumed with new tables, finish and leave holes that the last row fills."""
    work = workload(model, block_size, num_blocks, max_num_batched_tokens=max_num_batched_tokens)
    core, executor = build_rank(work, single_rank_group(), CPU)
    runner = executor.runner
    limits = StepLimits(work.max_num_batched_tokens, work.max_num_seqs)
    buffers = StepBuffers(
        runner.input_batch.block_table, runner.kv_cache_config, runner.kv_caches, limits, CPU
    )
    checking = BufferCheckingModel(runner.model, buffers)
    runner.model = checking
    outputs = run_to_completion(core)
    assert core.get_stats()["num_preemptions"] > 0
    assert checking.num_padded_steps > 0 and checking.num_steps > checking.num_padded_steps
    for idx in range(len(work.prompts)):
        assert outputs[idx + 1] == reference(model, idx), f"request {idx + 1}"
