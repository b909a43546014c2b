"""What only tiny-local (full, chunked-local and R-SWA layers) has: its groups, each spec's read
bounds, a request preempted past its R-SWA window, corrupted local tables, and a small gather
budget. Runs go through model_workloads.EngineNullsMirror, so a query that gathered a position
its layer may not read fails on the null block instead of reading a stale page by luck.

Its paged tokens (block sizes 4, 16 and 32, prefix caching on and off, chunked prefill across
chunk boundaries, preemption) are checked with the other models' in
test_models_paged_vs_reference.py.
"""

import numpy as np
import pytest
from model_workloads import (
    DEVICE,
    LOCAL,
    assert_matches_reference,
    build_mirrored,
    first_step_tokens,
    run,
    step_collecting_tokens,
    workload,
)

from bench.workload import Workload, build_rank, run_to_completion
from engine_core.sched.request import RequestStatus
from protocol.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from protocol.sampling import SamplingParams
from worker.attention import read_bounds, read_mask
from worker.distributed import single_rank_group
from worker.models.fake.reference import reference_generate
from worker.models.fake.tiny_llama import TINY_LOCAL

MODEL = TINY_LOCAL.name
CHUNK = 32  # TINY_LOCAL.attention_chunk_size
RSWA_WINDOW = 24  # TINY_LOCAL.rswa_window
FULL_GROUP, CHUNKED_GROUP, RSWA_GROUP = 0, 1, 2
PROMPTS, PARAMS = LOCAL.prompts, LOCAL.params

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_local_has_one_group_per_attention_kind() -> None:
    groups = TINY_LOCAL.kv_cache_groups(block_size=16, dtype="float32")
    assert [type(group.spec) for group in groups] == [
        FullAttentionSpec,
        ChunkedLocalAttentionSpec,
        RSWASpec,
    ]
    assert [group.layer_names for group in groups] == [
        ["layers.0.attn", "layers.3.attn"],
        ["layers.1.attn"],
        ["layers.2.attn"],
    ]
    assert groups[CHUNKED_GROUP].spec.attention_chunk_size == CHUNK
    assert groups[RSWA_GROUP].spec.rswa_window == RSWA_WINDOW


def _brute_force_reads(spec: KVCacheSpec, pos: int, num_prompt_tokens: int) -> set[int]:
    """What each spec's docstring says a query at `pos` reads."""
    match spec:
        case SlidingWindowSpec():
            return set(range(max(pos - spec.sliding_window + 1, 0), pos + 1))
        case ChunkedLocalAttentionSpec():
            size = spec.attention_chunk_size
            return set(range(pos // size * size, pos + 1))
        case RSWASpec():
            window = set(range(max(pos - spec.rswa_window, 0), pos + 1))
            return (set(range(num_prompt_tokens)) & set(range(pos + 1))) | window
    return set(range(pos + 1))


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(4, 1, 1, "float32"),
        SlidingWindowSpec(4, 1, 1, "float32", sliding_window=5),
        ChunkedLocalAttentionSpec(4, 1, 1, "float32", attention_chunk_size=8),
        RSWASpec(4, 1, 1, "float32", rswa_window=3),
    ],
    ids=lambda spec: type(spec).__name__,
)
def test_read_bounds_and_mask_give_exactly_what_each_spec_reads(spec: KVCacheSpec) -> None:
    positions = np.arange(40)
    ctx = np.arange(40)[None, :]
    for num_prompt_tokens in (1, 6, 13, 40):
        head_ends, tail_starts = read_bounds(spec, positions, num_prompt_tokens)
        mask = read_mask(spec, ctx, positions[:, None], num_prompt_tokens)
        for pos in positions.tolist():
            head, tail = int(head_ends[pos]), int(tail_starts[pos])
            expected = _brute_force_reads(spec, pos, num_prompt_tokens)
            assert head <= tail, f"position {pos}: head [0, {head}) overlaps tail from {tail}"
            assert set(range(head)) | set(range(tail, pos + 1)) == expected, f"position {pos}"
            assert set(np.flatnonzero(mask[pos]).tolist()) == expected, f"position {pos}"


def test_a_request_preempted_past_its_window_resumes_with_its_prompt() -> None:
    """A request preempted after decoding past prompt + window recomputes its generated tokens
    as generated ones (R-SWA reads its prompt and window), not as a longer prompt."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [PARAMS[0]] * 3
    work = Workload(MODEL, 16, 26, prompts, params, 32, check_invariants=True)
    core, mirror = build_mirrored(work)
    scheduler = core.scheduler
    tokens: dict[str, list[int]] = {str(i + 1): [] for i in range(3)}
    preempted_past_window: set[str] = set()
    for _ in range(1000):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        step_collecting_tokens(core, tokens)
        preempted_past_window |= {
            request.req_id
            for request in scheduler.waiting
            if request.status is RequestStatus.PREEMPTED
            and len(tokens[request.req_id]) > RSWA_WINDOW
        }
    assert preempted_past_window
    for req_id in preempted_past_window:
        handle = int(req_id)
        assert mirror.resumed_prompts[handle] == len(prompts[handle - 1])
    for i in range(3):
        expected = reference_generate(MODEL, prompts[i], params[i], handle=i + 1)
        assert tokens[str(i + 1)] == expected, f"request {i + 1}"


@pytest.mark.parametrize(
    ("group_idx", "block_idx"),
    [(RSWA_GROUP, 0), (CHUNKED_GROUP, 2)],
    ids=["rswa-prompt-block", "chunked-current-chunk"],
)
def test_a_corrupted_local_table_entry_changes_the_tokens(group_idx: int, block_idx: int) -> None:
    """The local layers read through their own block table: R-SWA its first prompt block long
    after the window has left it, chunked local the block of positions 32..47 while decoding in
    the chunk 32..63. The wrong entry names a block of the other request."""
    prompt, other = list(range(3, 43)), PROMPTS[3]  # 40 tokens, then 30 generated
    params = [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    expected = reference_generate(MODEL, prompt, params[0], handle=1)
    work = Workload(MODEL, 16, 40, [prompt, other], params, 200, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    tokens = first_step_tokens(core)  # both prefills, each with its first token
    batch = executor.runner.input_batch
    table = batch.block_table[group_idx]
    row, other_row = batch.handle_to_row[1], batch.handle_to_row[2]
    table.block_table[row, block_idx] = table.block_table[other_row, 0]
    outputs = run_to_completion(core)
    assert tokens and tokens + outputs[1] != expected


def test_prefills_split_by_a_small_gather_budget_keep_the_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget of 256 query x context entries splits every prefill into pieces of a few
    queries: each piece gathers the union of its queries' reads (the prompt head of its last
    query, the tail from its first query's start), and decodes go a couple per gather."""
    monkeypatch.setattr("worker.attention.GATHER_BUDGET", 256)
    result = run(workload(MODEL, 16, 61, max_num_batched_tokens=64))
    assert_matches_reference(MODEL, result.outputs)
    assert result.mirror is not None and result.mirror.num_nulled[RSWA_GROUP] > 0
