"""tiny-local (full, chunked-local and R-SWA layers) serves exactly the unpaged reference's tokens.

The engine's own Scheduler drives one ModelRunner. Before every step the runner's block tables
are made to mirror the engine's nulls: an entry the engine freed (an earlier chunk, the R-SWA gap)
becomes the null block, so a query that gathered a position its layer may not read would fail
on the null block instead of reading a stale page by luck.
"""

import functools
import random

import numpy as np
import pytest
import torch

from bench.workload import Workload, build_rank, run_to_completion
from engine_core.core import EngineCore
from engine_core.sched.request import RequestStatus
from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from tests.conftest import worker_test_device
from worker.attention import read_bounds, read_mask
from worker.distributed import single_rank_group
from worker.model_runner import ModelRunner, StepTimings
from worker.models.reference import reference_generate
from worker.models.tiny_llama import TINY_LOCAL

DEVICE = torch.device(worker_test_device())
MODEL = TINY_LOCAL.name
CHUNK = 32  # TINY_LOCAL.attention_chunk_size
RSWA_WINDOW = 24  # TINY_LOCAL.rswa_window
FULL_GROUP, CHUNKED_GROUP, RSWA_GROUP = 0, 1, 2
PARAMS = [
    SamplingParams(max_tokens=90, ignore_eos=True),  # far past the R-SWA window: the gap is freed
    SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.3, ignore_eos=True),  # unseeded: handle-derived
    SamplingParams(max_tokens=50, min_tokens=2, stop_token_ids=[5, 77, 301]),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 5..90 tokens; most share a prefix of up to 65 tokens so prefix caching hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(65)]
    prompts = []
    for i in range(count):
        head = shared[: rng.randrange(10, 65)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 26))])
    return prompts


PROMPTS = make_prompts(seed=5, count=6)


@functools.cache
def reference(prompt_idx: int) -> list[int]:
    params = PARAMS[prompt_idx % len(PARAMS)]
    return reference_generate(MODEL, PROMPTS[prompt_idx], params, handle=prompt_idx + 1)


class EngineNullsMirror:
    """Runs each step on the ModelRunner after nulling the table entries the engine has freed.

    The engine never tells the workers which blocks it freed (vLLM does not either): their tables
    keep the old ids, whose pages may already serve another request. Nulling them here turns a
    read of a freed position into the runner's "maps to the null block" error.
    """

    def __init__(self, core: EngineCore, runner: ModelRunner) -> None:
        self.core = core
        self.runner = runner
        self.num_nulled = [0, 0, 0]  # entries nulled per group, summed over steps
        self.resumed_prompts: dict[int, int] = {}  # handle -> worker prompt length when resumed
        self.num_null_hits = 0  # null blocks in new requests' chunked-local tables (prefix hits)

    @property
    def timings(self) -> StepTimings:
        return self.runner.timings

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._mirror_nulls()
        for new in scheduler_output.scheduled_new_reqs:
            self.num_null_hits += new.block_ids[CHUNKED_GROUP].count(NULL_BLOCK_ID)
        output = self.runner.execute_model(scheduler_output)
        batch = self.runner.input_batch
        for handle in scheduler_output.scheduled_cached_reqs.resumed_handles:
            self.resumed_prompts[handle] = int(batch.num_prompt_tokens[batch.handle_to_row[handle]])
        return output

    def _mirror_nulls(self) -> None:
        scheduler = self.core.scheduler
        batch = self.runner.input_batch
        for request in scheduler.running:
            row = batch.handle_to_row.get(request.handle)
            if row is None:
                continue  # new or resumed this step: the engine sends its whole table
            engine_ids = scheduler.kv_cache_manager.get_block_ids(request.req_id)
            for group_idx, ids in enumerate(engine_ids):
                table = batch.block_table[group_idx]
                num_held = int(table.num_blocks_per_row[row])
                freed = np.array(ids[:num_held]) == NULL_BLOCK_ID
                freed &= table.block_table[row, :num_held] != NULL_BLOCK_ID
                table.block_table[row, :num_held][freed] = NULL_BLOCK_ID
                self.num_nulled[group_idx] += int(freed.sum())


def run_mirrored(work: Workload) -> tuple[dict[int, list[int]], EngineNullsMirror, EngineCore]:
    core, mirror = build_mirrored(work)
    outputs = run_to_completion(core)
    mirror.runner.check_invariants()
    return outputs, mirror, core


def build_mirrored(work: Workload) -> tuple[EngineCore, EngineNullsMirror]:
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    mirror = EngineNullsMirror(core, executor.runner)
    executor.runner = mirror  # type: ignore[assignment]  # the TimedRunner calls it as the runner
    return core, mirror


def workload(block_size: int, num_blocks: int, **options: object) -> Workload:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    return Workload(
        MODEL, block_size, num_blocks, PROMPTS, params, check_invariants=True, **options
    )


def assert_matches_reference(outputs: dict[int, list[int]]) -> None:
    for i in range(len(PROMPTS)):
        assert outputs[i + 1] == reference(i), f"request {i + 1}"


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


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_paged_tokens_equal_reference(block_size: int, enable_prefix_caching: bool) -> None:
    """Chunked prefill (24 tokens a step) crosses chunk boundaries; decode frees earlier chunks
    and the R-SWA gap, which the mirror nulls, and prefix hits return earlier chunks as null."""
    num_blocks = 1 + 6 * 160 // block_size  # room for every request at once
    work = workload(
        block_size,
        num_blocks,
        max_num_batched_tokens=24,
        enable_prefix_caching=enable_prefix_caching,
    )
    outputs, mirror, core = run_mirrored(work)
    assert_matches_reference(outputs)
    assert mirror.num_nulled[FULL_GROUP] == 0
    assert mirror.num_nulled[CHUNKED_GROUP] > 0, "no earlier chunk was freed while running"
    assert mirror.num_nulled[RSWA_GROUP] > 0, "no R-SWA gap was freed while decoding"
    num_hit_tokens = int(core.get_stats()["prefix_cache_hits"])
    assert (num_hit_tokens > 0) == enable_prefix_caching
    # A hit past a chunk boundary arrives with the earlier chunk's blocks as null.
    assert (mirror.num_null_hits > 0) == enable_prefix_caching
    assert max(len(p) for p in PROMPTS) > 24 + CHUNK  # some prefill spans two step chunks past 32


# Pools too small for the batch, yet holding the longest request alone (the Scheduler refuses
# less). The chunked-local group holds only its current chunk; the R-SWA group, like full
# attention, is planned for its whole sequence.
TIGHT_NUM_BLOCKS = {4: 100, 16: 26, 32: 14}


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tokens_survive_preemption_and_recompute(
    block_size: int, enable_prefix_caching: bool
) -> None:
    """Preempted requests resume with their tables replaced; the worker keeps each one's prompt
    length across the preemption, so R-SWA reads the same prompt as before."""
    work = workload(
        block_size,
        TIGHT_NUM_BLOCKS[block_size],
        max_num_batched_tokens=32,
        enable_prefix_caching=enable_prefix_caching,
    )
    outputs, mirror, core = run_mirrored(work)
    assert int(core.get_stats()["num_preemptions"]) > 0
    assert mirror.resumed_prompts, "no preempted request resumed on the worker"
    for handle, num_prompt_tokens in mirror.resumed_prompts.items():
        assert num_prompt_tokens == len(PROMPTS[handle - 1]), f"request {handle}"
    assert_matches_reference(outputs)


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
        for client_outputs in core.step().values():
            for output in client_outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
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
    first_step = core.step()  # both prefills, each with its first token
    tokens = [
        token_id
        for client_outputs in first_step.values()
        for output in client_outputs.outputs
        if output.req_id == "1"
        for token_id in output.new_token_ids
    ]
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
    outputs, mirror, _ = run_mirrored(workload(16, 61, max_num_batched_tokens=64))
    assert_matches_reference(outputs)
    assert mirror.num_nulled[RSWA_GROUP] > 0
