"""Paged tokens equal the unpaged reference for every model, block size, caching mode and schedule.

The engine's own Scheduler drives one ModelRunner through chunked prefill, prefix hits (shared
blocks, same-step sharing), sliding-window blocks freed and reused, and preemption with recompute.
tiny-mla's latents, tiny-mamba-hybrid's states (align mode with a cache: block-aligned chunks
leave checkpoints later prompts resume from; one state block without), tiny-local's
chunked-local and R-SWA layers (run through EngineNullsMirror) and tiny-encdec's encoder blocks
take the same tests over their families' workloads (model_workloads.py), and so does
tiny-llama-hybrid-2x, whose window group's blocks are twice the engine's block size (requests
hash at --block-size, the gcd; its hits end on the larger size); test_tiny_*.py hold what only
one model has, test_models_tp_shards.py the TP shards.
"""

import pytest
from model_workloads import (
    DEVICE,
    PARAMS,
    PROMPTS,
    assert_matches_reference,
    family,
    first_step_tokens,
    reference,
    run,
    step_collecting_tokens,
    workload,
)

from bench.workload import Workload, build_rank, run_to_completion
from engine_core.sched.request import RequestStatus
from worker.distributed import single_rank_group
from worker.models.registry import get_model_info

MODELS = ["checksum", "tiny-llama", "tiny-llama-hybrid"]
STATE_MODELS = ["tiny-mla", "tiny-mamba-hybrid"]  # latents or Mamba states beside (or in) K/V
LOCAL_CHUNK = 32  # tiny-local's attention_chunk_size
LOCAL_FULL_GROUP, LOCAL_CHUNKED_GROUP, LOCAL_RSWA_GROUP = 0, 1, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cases(
    sizes: dict[str, tuple[int, ...]], caching: tuple[bool, ...] = (True, False)
) -> list[tuple[str, int, bool]]:
    return [
        (m, size, on) for m, model_sizes in sizes.items() for size in model_sizes for on in caching
    ]


# Room for several requests at once (tiny-local and tiny-encdec: for all six); every prompt
# longer than the step's token budget is chunked (tiny-encdec's 12 tokens: the encoder runs in
# the first chunk's step only, later chunks read its K/V from the blocks).
ROOMY_TOKENS = {"tiny-local": 6 * 160, "tiny-encdec": 6 * 160}  # 4 x 128 for the others
PAGED_MAX_NUM_BATCHED_TOKENS = {"tiny-encdec": 12}  # 24 for the others


@pytest.mark.parametrize(
    ("model", "block_size", "enable_prefix_caching"),
    cases({m: (1, 16, 32) for m in MODELS})
    + cases({m: (16, 32) for m in STATE_MODELS})
    + cases({"tiny-llama-hybrid-2x": (4, 16)})
    + cases({"tiny-local": (4, 16, 32)})
    + [("tiny-encdec", 4, True), ("tiny-encdec", 16, False), ("tiny-encdec", 32, True)],
)
def test_paged_tokens_equal_reference(
    model: str, block_size: int, enable_prefix_caching: bool
) -> None:
    num_blocks = 1 + ROOMY_TOKENS.get(model, 4 * 128) // block_size
    max_num_batched_tokens = PAGED_MAX_NUM_BATCHED_TOKENS.get(model, 24)
    work = workload(
        model,
        block_size,
        num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run(work)
    assert_matches_reference(model, result.outputs)
    assert (result.num_hit_tokens > 0) == enable_prefix_caching
    assert max(len(p) for p in family(model).prompts) > max_num_batched_tokens
    if result.mirror is not None:
        # tiny-local: chunked prefill crosses chunk boundaries; decode frees earlier chunks and
        # the R-SWA gap, which the mirror nulls, and prefix hits return earlier chunks as null.
        mirror = result.mirror
        assert mirror.num_nulled[LOCAL_FULL_GROUP] == 0
        assert mirror.num_nulled[LOCAL_CHUNKED_GROUP] > 0, "no earlier chunk was freed"
        assert mirror.num_nulled[LOCAL_RSWA_GROUP] > 0, "no R-SWA gap was freed while decoding"
        assert (mirror.num_null_hits > 0) == enable_prefix_caching
        # some prefill spans two step chunks past 32
        assert max(len(p) for p in family(model).prompts) > 24 + LOCAL_CHUNK


# Pools too small for the batch at each block size, yet holding the longest request alone (the
# Scheduler refuses less); the hybrid's window group needs blocks of its own, but only as many as
# its window of 48 and 32 tokens a step span: at block sizes 1, 4 and 32 the least the Scheduler
# admits (167 < 2 x 86 + 1 at size 1); at 16 that least (13) never preempts. Each block id serves
# one group at a time from tensors the groups share.
# tiny-mla's latents fit the plain pools; tiny-mamba-hybrid also holds two state blocks, and
# plans 48 tokens a step so that its chunks end on block boundaries past the shared prefixes.
# tiny-local's chunked-local group holds only its current chunk; its R-SWA group, like full
# attention, is planned for its whole sequence. tiny-encdec's preempted requests lose their
# encoder blocks and resume with new ones, into which the worker encodes their input again.
# tiny-llama-hybrid-2x in 36 blocks of 4: the longest request (86 tokens) holds 22
# full-attention blocks of 4 and cdiv(47 + 24, 8) + 1 = 10 window blocks of 8 (the Scheduler
# admits 33 and up), too few for the batch.
TIGHT_NUM_BLOCKS = {1: 87, 4: 23, 16: 9, 32: 4}
TIGHT_HYBRID_NUM_BLOCKS = {1: 167, 4: 44, 16: 17, 32: 7}
TIGHT_MAMBA_NUM_BLOCKS = {16: 11, 32: 6}
TIGHT_POOLS = {
    "tiny-llama-hybrid": TIGHT_HYBRID_NUM_BLOCKS,
    "tiny-mamba-hybrid": TIGHT_MAMBA_NUM_BLOCKS,
    "tiny-local": {4: 100, 16: 26, 32: 14},
    "tiny-encdec": {4: 40, 16: 12},
    "tiny-llama-hybrid-2x": {4: 36},
}
MAX_NUM_BATCHED_TOKENS = {
    "tiny-mamba-hybrid": 48,
    "tiny-encdec": 16,
    "tiny-llama-hybrid-2x": 24,
}  # 32 for the others


@pytest.mark.parametrize(
    ("model", "block_size", "enable_prefix_caching"),
    cases({m: (1, 4, 16, 32) for m in MODELS})
    + cases({m: (16, 32) for m in STATE_MODELS})
    + cases({"tiny-llama-hybrid-2x": (4,)})
    + cases({"tiny-local": (4, 16, 32)})
    + cases({"tiny-encdec": (4, 16)}, caching=(True,)),
)
def test_tokens_survive_preemption_and_recompute(
    model: str, block_size: int, enable_prefix_caching: bool
) -> None:
    """Too few blocks for the batch: the last running request is preempted and later resumed.

    Guards the resumed path at every block size, not only at 4: a replacement table whose
    length or slot arithmetic depended on the block size would change the tokens. Resumed
    tiny-mla requests recompute their latents, tiny-mamba-hybrid ones their states from a hit or
    from zero, tiny-encdec ones their encoder K/V: a read from a block of the old table would
    change the tokens.
    """
    pools = TIGHT_POOLS.get(model, TIGHT_NUM_BLOCKS)
    work = workload(
        model,
        block_size,
        pools[block_size],
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS.get(model, 32),
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run(work)
    assert result.num_preemptions > 0
    if result.mirror is not None:
        # tiny-local: the worker keeps each resumed request's prompt length across the
        # preemption, so R-SWA reads the same prompt as before.
        assert result.mirror.resumed_prompts, "no preempted request resumed on the worker"
        for handle, num_prompt_tokens in result.mirror.resumed_prompts.items():
            assert num_prompt_tokens == len(family(model).prompts[handle - 1]), handle
    assert_matches_reference(model, result.outputs)


def test_the_2x_window_group_uses_twice_the_block_size() -> None:
    groups = get_model_info("tiny-llama-hybrid-2x", 4).kv_cache_groups
    assert [group.spec.block_size for group in groups] == [4, 8]


@pytest.mark.parametrize("model", ["tiny-llama-hybrid", *STATE_MODELS])
def test_float64_kv_cache_gives_the_same_tokens(model: str) -> None:
    result = run(workload(model, 16, 40, dtype="float64"))
    assert_matches_reference(model, result.outputs)


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
        step_collecting_tokens(core, tokens)
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
    tokens: dict[str, list[int]] = {req_id: [] for req_id in scheduler.requests}
    ids_per_group: tuple[set[int], set[int]] = (set(), set())
    for _ in range(500):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        step_collecting_tokens(core, tokens)
        for request in scheduler.running:
            blocks_per_group = coordinator.get_blocks(request.req_id)
            for ids, blocks in zip(ids_per_group, blocks_per_group, strict=True):
                ids.update(block.block_id for block in blocks if not block.is_null)
    assert len(ids_per_group[0] & ids_per_group[1]) > 10
    for i in range(len(PROMPTS)):
        assert tokens[str(i + 1)] == reference("tiny-llama-hybrid", i), f"{i + 1}"


@pytest.mark.parametrize("model", [*MODELS, "tiny-mla"])
def test_a_corrupted_block_table_entry_changes_the_tokens(model: str) -> None:
    """Proves the models read K/V (tiny-mla: latents) through the block table: one wrong entry,
    different tokens."""
    prompts = [PROMPTS[0], PROMPTS[3]]  # 8 tokens (blocks 0 and 1 of 4 tokens), then 9 tokens
    work = Workload(model, 4, 80, prompts, [PARAMS[0]] * 2, 200, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    tokens = first_step_tokens(core)  # both prefills, each with its first token
    input_batch = executor.runner.input_batch
    table = input_batch.block_table[0]
    row, other = input_batch.handle_to_row[1], input_batch.handle_to_row[2]
    table.block_table[row, 1] = table.block_table[other, 1]  # positions 4..7 read the other's
    outputs = run_to_completion(core)
    expected = reference(model, 0, 0)
    assert tokens == expected[:1] and tokens + outputs[1] != expected
