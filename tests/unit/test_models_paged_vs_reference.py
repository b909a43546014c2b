"""Paged tokens equal the unpaged reference for every model, block size, caching mode and schedule.

The engine's own Scheduler drives one ModelRunner through chunked prefill, prefix hits (shared
blocks, same-step sharing), sliding-window blocks freed and reused, and preemption with recompute.
tiny-mla's latents and tiny-mamba-hybrid's states (align mode with a cache: block-aligned chunks
leave checkpoints later prompts resume from; one state block without) take the same workloads;
test_tiny_mla.py and test_tiny_mamba.py hold what only they have.
"""

import functools
import random

import pytest
import torch

from bench.workload import RankResult, Workload, build_rank, run_to_completion, run_workload
from engine_core.sched.request import RequestStatus
from protocol.sampling import SamplingParams
from tests.conftest import worker_test_device
from worker.distributed import TPGroup, single_rank_group
from worker.models.checksum import CHECKSUM, ChecksumModel
from worker.models.reference import reference_generate
from worker.models.tiny_llama import TINY_LLAMA, TinyLlama

DEVICE = torch.device(worker_test_device())
MODELS = ["checksum", "tiny-llama", "tiny-llama-hybrid"]
STATE_MODELS = ["tiny-mla", "tiny-mamba-hybrid"]  # latents or Mamba states beside (or in) K/V
PARAMS = [
    SamplingParams(max_tokens=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.3, ignore_eos=True),  # unseeded: handle-derived
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 10..90 tokens; most share a 70-token prefix so prefix caching hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(70)]
    prompts = []
    for i in range(count):
        head = shared[: rng.randrange(10, 70)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 25))])
    return prompts


PROMPTS = make_prompts(seed=3, count=6)


@functools.cache
def reference(model: str, prompt_idx: int, params_idx: int) -> list[int]:
    params = PARAMS[params_idx]
    return reference_generate(model, PROMPTS[prompt_idx], params, handle=prompt_idx + 1)


def workload(model: str, block_size: int, num_blocks: int, **options: object) -> Workload:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    return Workload(
        model, block_size, num_blocks, PROMPTS, params, check_invariants=True, **options
    )


def assert_matches_reference(model: str, result: RankResult) -> None:
    for i in range(len(PROMPTS)):
        assert result.outputs[i + 1] == reference(model, i, i % len(PARAMS)), f"request {i + 1}"


@pytest.mark.parametrize(
    ("model", "block_size"),
    [(m, size) for m in MODELS for size in (1, 16, 32)]
    + [(m, size) for m in STATE_MODELS for size in (16, 32)],
)
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_paged_tokens_equal_reference(
    model: str, block_size: int, enable_prefix_caching: bool
) -> None:
    num_blocks = 1 + 4 * 128 // block_size  # room for several requests at once
    work = workload(
        model,
        block_size,
        num_blocks,
        max_num_batched_tokens=24,  # every prompt longer than 24 tokens is chunked
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    assert_matches_reference(model, result)
    assert (result.num_hit_tokens > 0) == enable_prefix_caching
    assert max(len(p) for p in PROMPTS) > 24


# Pools too small for the batch at each block size, yet holding the longest request alone (the
# Scheduler refuses less); the hybrid's window group needs blocks of its own, but only as many as
# its window of 48 and 32 tokens a step span: at block sizes 1, 4 and 32 the least the Scheduler
# admits (167 < 2 x 86 + 1 at size 1); at 16 that least (13) never preempts. Each block id serves
# one group at a time from tensors the groups share.
# tiny-mla's latents fit the plain pools; tiny-mamba-hybrid also holds two state blocks, and
# plans 48 tokens a step so that its chunks end on block boundaries past the shared prefixes.
TIGHT_NUM_BLOCKS = {1: 87, 4: 23, 16: 9, 32: 4}
TIGHT_HYBRID_NUM_BLOCKS = {1: 167, 4: 44, 16: 17, 32: 7}
TIGHT_MAMBA_NUM_BLOCKS = {16: 11, 32: 6}
TIGHT_POOLS = {
    "tiny-llama-hybrid": TIGHT_HYBRID_NUM_BLOCKS,
    "tiny-mamba-hybrid": TIGHT_MAMBA_NUM_BLOCKS,
}
MAX_NUM_BATCHED_TOKENS = {"tiny-mamba-hybrid": 48}  # 32 for the others


@pytest.mark.parametrize(
    ("model", "block_size"),
    [(m, size) for m in MODELS for size in (1, 4, 16, 32)]
    + [(m, size) for m in STATE_MODELS for size in (16, 32)],
)
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tokens_survive_preemption_and_recompute(
    model: str, block_size: int, enable_prefix_caching: bool
) -> None:
    """Too few blocks for the batch: the last running request is preempted and later resumed.

    Guards the resumed path at every block size, not only at 4: a replacement table whose
    length or slot arithmetic depended on the block size would change the tokens. Resumed
    tiny-mla requests recompute their latents, tiny-mamba-hybrid ones their states from a hit or
    from zero: a read from a block of the old table would change the tokens.
    """
    pools = TIGHT_POOLS.get(model, TIGHT_NUM_BLOCKS)
    work = workload(
        model,
        block_size,
        pools[block_size],
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS.get(model, 32),
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    assert result.num_preemptions > 0
    assert_matches_reference(model, result)


@pytest.mark.parametrize("model", ["tiny-llama-hybrid", *STATE_MODELS])
def test_float64_kv_cache_gives_the_same_tokens(model: str) -> None:
    result = run_workload(workload(model, 16, 40, dtype="float64"), single_rank_group(), DEVICE)
    assert_matches_reference(model, result)


def test_preemption_of_a_decoding_request_keeps_its_tokens() -> None:
    """Three requests outgrow a 23-block pool while decoding: two are preempted after sampling
    some tokens, recompute them and go on to the reference tokens."""
    prompts = PROMPTS[:3]  # 8, 70 and 57 tokens: 20 blocks of 4 for the longest
    work = Workload("tiny-llama", 4, 23, prompts, [PARAMS[0]] * 3, 200, check_invariants=True)
    core, _ = build_rank(work, single_rank_group(), DEVICE)
    scheduler = core.scheduler
    tokens: dict[str, list[int]] = {str(i + 1): [] for i in range(3)}
    preempted_while_decoding: set[str] = set()
    for _ in range(100):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        for client_outputs in core.step().values():
            for output in client_outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
        preempted_while_decoding |= {
            request.req_id
            for request in scheduler.waiting
            if request.status is RequestStatus.PREEMPTED and tokens[request.req_id]
        }
    assert preempted_while_decoding == {"2", "3"} and scheduler.num_preemptions == 2
    for i in range(3):
        assert tokens[str(i + 1)] == reference("tiny-llama", i, 0)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_hybrid_block_ids_pass_between_groups_that_share_tensors(
    enable_prefix_caching: bool,
) -> None:
    """A block the window group freed is handed to the full-attention group (and back) while
    both groups' layers view the same tensors: a stale page read across groups, or a null block
    written through either view, would change the tokens or fail the runner's invariants."""
    work = workload(
        "tiny-llama-hybrid",
        4,
        TIGHT_HYBRID_NUM_BLOCKS[4],
        max_num_batched_tokens=32,
        enable_prefix_caching=enable_prefix_caching,
    )
    core, _ = build_rank(work, single_rank_group(), DEVICE)
    scheduler = core.scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    handles = {req_id: request.handle for req_id, request in scheduler.requests.items()}
    outputs: dict[int, list[int]] = {handle: [] for handle in handles.values()}
    ids_per_group: tuple[set[int], set[int]] = (set(), set())
    for _ in range(500):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        for client_outputs in core.step().values():
            for output in client_outputs.outputs:
                outputs[handles[output.req_id]].extend(output.new_token_ids)
        for request in scheduler.running:
            blocks_per_group = coordinator.get_blocks(request.req_id)
            for ids, blocks in zip(ids_per_group, blocks_per_group, strict=True):
                ids.update(block.block_id for block in blocks if not block.is_null)
    assert len(ids_per_group[0] & ids_per_group[1]) > 10
    for i in range(len(PROMPTS)):
        assert outputs[i + 1] == reference("tiny-llama-hybrid", i, i % len(PARAMS)), f"{i + 1}"


@pytest.mark.parametrize("model", [*MODELS, "tiny-mla"])
def test_a_corrupted_block_table_entry_changes_the_tokens(model: str) -> None:
    """Proves the models read K/V (tiny-mla: latents) through the block table: one wrong entry,
    different tokens."""
    prompts = [PROMPTS[0], PROMPTS[3]]  # 8 tokens (blocks 0 and 1 of 4 tokens), then 9 tokens
    work = Workload(model, 4, 80, prompts, [PARAMS[0]] * 2, 200, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    first_step = core.step()  # both prefills, each with its first token
    tokens = [
        token_id
        for client_outputs in first_step.values()
        for output in client_outputs.outputs
        if output.req_id == "1"
        for token_id in output.new_token_ids
    ]
    input_batch = executor.runner.input_batch
    table = input_batch.block_table[0]
    row, other = input_batch.handle_to_row[1], input_batch.handle_to_row[2]
    table.block_table[row, 1] = table.block_table[other, 1]  # positions 4..7 read the other's
    outputs = run_to_completion(core)
    expected = reference(model, 0, 0)
    assert tokens == expected[:1] and tokens + outputs[1] != expected


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_partition_the_full_weights(tp_size: int) -> None:
    """Each rank draws the full weights from the seed and keeps its slice; the slices tile them."""
    full = TinyLlama(TINY_LLAMA, single_rank_group(), 0, DEVICE)
    placeholder = object()  # a process group is never used: no forward runs here
    shards = [
        TinyLlama(TINY_LLAMA, TPGroup(r, tp_size, placeholder), 0, DEVICE) for r in range(tp_size)
    ]
    for shard in shards:
        shard.check_invariants()
    for layer_idx, layer in enumerate(full.layers):
        parts = [shard.layers[layer_idx] for shard in shards]
        assert torch.equal(torch.cat([p.wq for p in parts], dim=1), layer.wq)
        assert torch.equal(torch.cat([p.wk for p in parts], dim=1), layer.wk)
        assert torch.equal(torch.cat([p.wo for p in parts], dim=0), layer.wo)
        assert torch.equal(torch.cat([p.w_gate for p in parts], dim=1), layer.w_gate)
        assert torch.equal(torch.cat([p.w_down for p in parts], dim=0), layer.w_down)
    heads = [
        ChecksumModel(CHECKSUM, TPGroup(r, tp_size, placeholder), DEVICE) for r in range(tp_size)
    ]
    for model in heads:
        model.check_invariants()
    assert torch.cat([m.heads for m in heads]).tolist() == list(range(CHECKSUM.num_kv_heads))
