"""tiny-mamba-hybrid's states are read and written through the Mamba group's block table, so a
wrong block id or a lost checkpoint changes the tokens; asynchronous scheduling and random
arrivals and aborts keep the reference tokens.

Its paged tokens at block sizes 16 and 32, prefix caching on (align mode: checkpoints, hits) and
off (one state block), with chunked prefill, preemption and float64, are checked with the other
models' in test_models_paged_vs_reference.py, its TP shards in test_models_tp_shards.py.
"""

import random

import pytest
from model_workloads import (
    DEVICE,
    PARAMS,
    PROMPTS,
    assert_matches_reference,
    first_step_tokens,
    run,
    step_collecting_tokens,
    workload,
)
from test_models_paged_vs_reference import TIGHT_MAMBA_NUM_BLOCKS

from bench.workload import Workload, build_rank, run_to_completion
from engine_client.request import make_request
from protocol.kv_cache_spec import FullAttentionSpec, MambaSpec, cdiv
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.distributed import single_rank_group
from worker.model_runner import ModelRunner, StepTimings
from worker.models.fake.reference import ReferenceModel, reference_generate
from worker.models.fake.tiny_mamba import TINY_MAMBA_HYBRID
from worker.models.registry import get_model_info

MODEL = TINY_MAMBA_HYBRID.name
MAMBA_GROUP = 1

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_groups_are_full_attention_then_align_mode_states() -> None:
    groups = get_model_info(MODEL, 16).kv_cache_groups
    assert [type(group.spec) for group in groups] == [FullAttentionSpec, MambaSpec]
    assert groups[MAMBA_GROUP].spec.mamba_cache_mode == "align"
    assert groups[MAMBA_GROUP].layer_names == ["layers.1.mamba", "layers.3.mamba"]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_asynchronous_scheduling_gives_the_same_tokens(enable_prefix_caching: bool) -> None:
    """The next step is planned before the workers answer, on a placeholder token: its state
    blocks still follow the rule, through hits, chunks and preemption."""
    work = workload(
        MODEL,
        16,
        TIGHT_MAMBA_NUM_BLOCKS[16],
        max_num_batched_tokens=24,
        enable_prefix_caching=enable_prefix_caching,
        async_scheduling=True,
    )
    result = run(work)
    assert result.num_preemptions > 0
    assert (result.num_hit_tokens > 0) == enable_prefix_caching
    assert_matches_reference(MODEL, result.outputs)


class CheckpointWatch:
    """Runs each step on the ModelRunner; a new request that starts past token 0 (a prefix hit)
    has its starting state block recorded, and zeroed first when `lose_checkpoint` is set."""

    def __init__(self, runner: ModelRunner, lose_checkpoint: bool) -> None:
        self.runner = runner
        self.lose_checkpoint = lose_checkpoint
        self.resumed: list[tuple[int, list[int]]] = []  # (hit tokens, Mamba table) per new hit

    @property
    def timings(self) -> StepTimings:
        return self.runner.timings

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        group = self.runner.kv_cache_config.kv_cache_groups[MAMBA_GROUP]
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens == 0:
                continue
            table = new.block_ids[MAMBA_GROUP]
            self.resumed.append((new.num_computed_tokens, table))
            checkpoint = table[cdiv(new.num_computed_tokens, group.spec.block_size) - 1]
            for name in group.layer_names:
                if self.lose_checkpoint:
                    self.runner.kv_caches[name][checkpoint] = 0
        return self.runner.execute_model(scheduler_output)


@pytest.mark.parametrize("lose_checkpoint", [False, True], ids=["kept", "lost"])
def test_a_prefix_hit_resumes_from_the_checkpoint_block(lose_checkpoint: bool) -> None:
    """A 45-token prompt at block size 16 is prefilled in chunks ending at 32 (the last boundary
    an identical prefix can hit) and 45; a second prompt sharing 40 of its 45 tokens resumes from
    the state at 32 in that block: zeroing the block changes its tokens."""
    rng = random.Random(9)
    first = [rng.randrange(3, 500) for _ in range(45)]
    second = first[:40] + [rng.randrange(3, 500) for _ in range(5)]  # within max_model_len
    work = Workload(MODEL, 16, 40, [first], [PARAMS[0]], 64, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    watch = CheckpointWatch(executor.runner, lose_checkpoint)
    executor.runner = watch  # type: ignore[assignment]  # the TimedRunner calls it as the runner
    assert run_to_completion(core)[1] == reference_generate(MODEL, first, PARAMS[0], handle=1)
    assert core.add_request(make_request("2", second, PARAMS[0])) is None
    outputs = run_to_completion(core)
    [(num_hit_tokens, table)] = watch.resumed
    assert num_hit_tokens == 32 and table[0] == 0 and table[1] != 0, table
    expected = reference_generate(MODEL, second, PARAMS[0], handle=2)
    assert (outputs[2] == expected) != lose_checkpoint


def test_a_corrupted_state_block_id_changes_the_tokens() -> None:
    """Without a prefix cache each request keeps one state block; pointing one request's table
    at an unused block after its first step makes it resume from a zero state."""
    prompts = [PROMPTS[0], PROMPTS[3]]
    work = Workload(MODEL, 4, 80, prompts, [PARAMS[0]] * 2, 200, enable_prefix_caching=False)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    tokens = first_step_tokens(core)  # both prefills, each with its first token
    input_batch = executor.runner.input_batch
    table = input_batch.block_table[MAMBA_GROUP]
    row = input_batch.handle_to_row[1]
    assert table.num_blocks_per_row[row] == 1
    table.block_table[row, 0] = 79  # a block no request holds: all zeros
    outputs = run_to_completion(core)
    expected = reference_generate(MODEL, prompts[0], PARAMS[0], handle=1)
    assert tokens == expected[:1] and tokens + outputs[1] != expected


FUZZ_STEPS = 200
FUZZ_NUM_BLOCKS = 14  # the longest request needs 8 attention and 2 state blocks of 8 tokens


@pytest.mark.parametrize(
    ("enable_prefix_caching", "async_scheduling", "seed"),
    [(True, False, 1), (True, True, 2), (False, False, 3)],
    ids=["cached-sync", "cached-async", "uncached-sync"],
)
def test_random_arrivals_and_aborts_serve_the_reference_tokens(
    enable_prefix_caching: bool, async_scheduling: bool, seed: int
) -> None:
    """Requests over three shared prefixes arrive at random into a pool that forces preemption,
    some are aborted: every state is loaded where the engine says it was stored, so each
    request's tokens (a prefix of them when aborted) equal the reference."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
    prompts = {"1": bases[0] + [rng.randrange(3, 500) for _ in range(16)]}  # sets max_model_len
    greedy = [SamplingParams(max_tokens=8, ignore_eos=True)]
    work = Workload(
        MODEL,
        8,
        FUZZ_NUM_BLOCKS,
        [prompts["1"]],
        greedy,
        24,  # max_num_batched_tokens
        6,  # max_num_seqs
        enable_prefix_caching,
        check_invariants=True,
        async_scheduling=async_scheduling,
    )
    core, _ = build_rank(work, single_rank_group(), DEVICE)
    params = {"1": greedy[0]}
    outputs: dict[str, list[int]] = {"1": []}
    aborted: set[str] = set()
    for step_idx in range(FUZZ_STEPS):
        is_open = step_idx < FUZZ_STEPS * 2 // 3  # then the last requests drain
        if is_open and rng.random() < 0.3 and core.num_unfinished_requests < 8:
            req_id = str(len(prompts) + 1)
            head = rng.choice(bases)[: rng.randrange(0, 41)]
            prompts[req_id] = head + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 16))]
            params[req_id] = SamplingParams(max_tokens=rng.randrange(1, 9), ignore_eos=True)
            outputs[req_id] = []
            assert core.add_request(make_request(req_id, prompts[req_id], params[req_id])) is None
        if rng.random() < 0.03 and core.num_unfinished_requests:
            victim = rng.choice(list(core.scheduler.requests.values())).req_id
            aborted.add(victim)
            core.abort_requests([victim])
        step_collecting_tokens(core, outputs)
    assert not core.has_work(), "every request should have finished"
    assert core.kv_cache_usage == 0.0 and core.get_stats()["num_preemptions"] > 0
    assert (core.get_stats()["prefix_cache_hits"] > 0) == enable_prefix_caching
    reference_model = ReferenceModel(MODEL)  # one for all prompts: one per prompt doubles the time
    for req_id, prompt in prompts.items():
        expected = reference_model.generate(prompt, params[req_id])
        if req_id in aborted:
            expected = expected[: len(outputs[req_id])]
        assert outputs[req_id] == expected, req_id
