"""ModelRunner fed hand-written SchedulerOutputs: new, cached, resumed, finished, preempted."""

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from in_process_engine import model_runner

from protocol.buffers import pack_int32, unpack_int32
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, NewRequestData, SchedulerOutput
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.input_batch import InputBatch, ParkedRequest
from worker.model_runner import UNSAMPLED_TOKEN_ID, ModelRunner, build_model_runner
from worker.models.fake.reference import reference_generate
from worker.models.registry import get_model_info
from worker.sampler import SampleBatch, Sampler, greedy_tokens, uniform_draw

DEVICE = torch.device(worker_test_device())
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT_A = [11, 12, 13, 14, 15, 16]
PROMPT_B = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_runner(model_name: str = "checksum", num_blocks: int = 16) -> ModelRunner:
    info = get_model_info(model_name, BLOCK_SIZE)
    config = KVCacheConfig(num_blocks, info.kv_cache_groups)
    return model_runner(model_name, config, DEVICE, info.max_model_len)


def new_req(
    handle: int,
    prompt: list[int],
    block_ids: list[int],
    num_computed: int = 0,
    params: SamplingParams = GREEDY,
) -> NewRequestData:
    return NewRequestData(handle, pack_int32(prompt), params, (block_ids,), num_computed)


def cached(
    entries: list[tuple[int, list[int], list[int] | None, int]], resumed: tuple[int, ...] = ()
) -> CachedRequestData:
    """entries: (handle, new tokens, new block ids or None, num_computed_tokens)."""
    return CachedRequestData(
        handles=pack_int32(e[0] for e in entries),
        resumed_handles=list(resumed),
        new_token_ids=pack_int32(t for e in entries for t in e[1]),
        num_new_token_ids=pack_int32(len(e[1]) for e in entries),
        new_block_ids=[None if e[2] is None else (e[2],) for e in entries],
        num_computed_tokens=pack_int32(e[3] for e in entries),
    )


def step(
    step_id: int,
    counts: list[int],
    new: list[NewRequestData] | None = None,
    cached_reqs: CachedRequestData | None = None,
    finished: list[int] | None = None,
    preempted: list[int] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        step_id,
        new or [],
        cached_reqs or CachedRequestData(),
        pack_int32(counts),
        sum(counts),
        finished or [],
        preempted or [],
    )


def sampled(runner: ModelRunner, scheduler_output: SchedulerOutput) -> list[int]:
    output = runner.execute_model(scheduler_output)
    runner.check_invariants()
    assert output.step_id == scheduler_output.step_id and output.rank == 0
    return list(unpack_int32(output.sampled_token_ids))


@pytest.mark.parametrize("model_name", ["checksum", "tiny-llama"])
def test_new_request_then_decode_steps_match_the_reference(model_name: str) -> None:
    """The runner keeps each token it samples: the engine sends no token back."""
    ref = reference_generate(model_name, PROMPT_A, GREEDY)
    runner = make_runner(model_name)
    assert sampled(runner, step(1, [6], new=[new_req(1, PROMPT_A, [1, 2])])) == [ref[0]]
    assert sampled(runner, step(2, [1], cached_reqs=cached([(1, [], None, 6)]))) == [ref[1]]
    assert sampled(runner, step(3, [1], cached_reqs=cached([(1, [], [3], 7)]))) == [ref[2]]
    assert runner.timings.model_s > 0 and runner.timings.prepare_s > 0


def test_partial_prefill_chunk_is_not_sampled() -> None:
    ref = reference_generate("checksum", PROMPT_B, GREEDY)
    runner = make_runner()
    assert sampled(runner, step(1, [4], new=[new_req(1, PROMPT_B, [5, 6])])) == [UNSAMPLED_TOKEN_ID]
    assert sampled(runner, step(2, [6], cached_reqs=cached([(1, [], [7], 4)]))) == [ref[0]]


def test_preempted_request_keeps_its_tokens_and_resumes_with_replaced_blocks() -> None:
    ref = reference_generate("checksum", PROMPT_A, GREEDY)
    runner = make_runner()
    sampled(runner, step(1, [6], new=[new_req(1, PROMPT_A, [1, 2])]))
    sampled(runner, step(2, [1], cached_reqs=cached([(1, [], None, 6)])))
    sampled(runner, step(3, [], preempted=[1]))
    assert runner.input_batch.num_reqs == 0 and len(runner.parked[1].token_ids) == 8
    # blocks 1 and 2 are reused by someone else; the resumed request recomputes in 9 and 10
    sampled(runner, step(4, [5], new=[new_req(2, PROMPT_B[:5], [1, 2])]))
    resumed = cached([(1, [], [9, 10], 0)], resumed=(1,))
    assert sampled(runner, step(5, [8], cached_reqs=resumed)) == [ref[2]]
    assert runner.input_batch.block_table[0].row(runner.input_batch.handle_to_row[1]).tolist() == [
        9,
        10,
    ]


def test_finished_request_frees_its_row_and_rows_stay_compact() -> None:
    runner = make_runner()
    news = [new_req(1, [1, 2], [1]), new_req(2, [3, 4], [2]), new_req(3, [5, 6], [3])]
    sampled(runner, step(1, [2, 2, 2], new=news))
    sampled(runner, step(2, [], finished=[2]))
    batch = runner.input_batch
    assert batch.handle_to_row == {1: 0, 3: 1}
    assert batch.block_table[0].row(1).tolist() == [3]
    assert batch.token_ids[1, :2].tolist() == [5, 6]


@pytest.mark.parametrize("model_name", ["checksum", "tiny-llama"])
def test_same_step_prefix_sharing_reads_blocks_written_in_that_step(model_name: str) -> None:
    """The second request hits block 1, which the first request writes in the same step."""
    prompt_c = [*PROMPT_B[:4], 40, 41, 42]
    runner = make_runner(model_name)
    news = [new_req(1, PROMPT_B, [1, 2, 3]), new_req(2, prompt_c, [1, 4], num_computed=4)]
    got = sampled(runner, step(1, [10, 3], new=news))
    assert got == [
        reference_generate(model_name, PROMPT_B, GREEDY)[0],
        reference_generate(model_name, prompt_c, GREEDY)[0],
    ]


def test_batch_of_decodes_matches_per_request_reference() -> None:
    prompts = [[i, i + 1, i + 2] for i in range(3, 30, 3)]
    refs = [reference_generate("checksum", p, GREEDY) for p in prompts]
    runner = make_runner(num_blocks=40)
    news = [new_req(i, p, [2 * i + 1, 2 * i + 2]) for i, p in enumerate(prompts)]
    assert sampled(runner, step(1, [3] * len(prompts), new=news)) == [r[0] for r in refs]
    entries = [(i, [], None, 3) for i in range(len(prompts))]  # each rank kept its samples
    assert sampled(runner, step(2, [1] * len(prompts), cached_reqs=cached(entries))) == [
        r[1] for r in refs
    ]


@pytest.mark.parametrize(
    ("bad_step", "message"),
    [
        (step(2, [2], new=[new_req(1, [1, 2], [1])]), "got step 2, expected 1"),
        (step(1, [2], cached_reqs=cached([(7, [1], None, 0)])), "cached request 7 has no row"),
        (step(1, [3], new=[new_req(1, [1, 2], [1])]), r"schedules positions \[0, 3\)"),
        (step(1, [2], new=[new_req(1, [1, 2], [0])]), "maps to the null block"),
        (
            step(1, [5], new=[new_req(1, [1, 2, 3, 4, 5], [1])]),
            "needs block 1, but the row holds 1",
        ),
        (step(1, [1], new=[new_req(1, [], [1])]), "empty prompt"),
        (step(1, [2, 2], new=[new_req(1, [1, 2], [1])]), "2 token counts for 1 requests"),
        (step(1, [2], preempted=[4]), "preempted request 4 is unknown"),
    ],
)
def test_inconsistent_scheduler_output_is_rejected(bad_step: SchedulerOutput, message: str) -> None:
    runner = make_runner()
    with pytest.raises(ValueError, match=message):
        runner.execute_model(bad_step)


def test_mismatched_cached_columns_and_resume_without_blocks_are_rejected() -> None:
    runner = make_runner()
    sampled(runner, step(1, [2], new=[new_req(1, [1, 2], [1])]))
    short = CachedRequestData(handles=pack_int32([1]), new_block_ids=[None])
    with pytest.raises(ValueError, match="cached request columns disagree"):
        runner.execute_model(step(2, [1], cached_reqs=short))
    runner = make_runner()
    sampled(runner, step(1, [2], new=[new_req(1, [1, 2], [1])]))
    sampled(runner, step(2, [], preempted=[1]))
    with pytest.raises(ValueError, match="resumed request 1 comes without block ids"):
        runner.execute_model(step(3, [3], cached_reqs=cached([(1, [9], None, 0)], resumed=(1,))))
    with pytest.raises(ValueError, match="already known"):
        make_runner().execute_model(step(1, [2, 2], new=[new_req(1, [1, 2], [1])] * 2))


def test_resume_of_a_request_still_in_the_batch_is_rejected() -> None:
    """Guards against an engine bug passing silently: resuming a request that was never preempted
    used to append its tokens and replace its table in place, so the ranks ran on a wrong batch."""
    runner = make_runner()
    sampled(runner, step(1, [2], new=[new_req(1, [1, 2], [1])]))
    resumed = cached([(1, [9], [2], 0)], resumed=(1,))
    with pytest.raises(
        ValueError, match="resumed request 1 is still in the batch of rank 0 at row 0"
    ):
        runner.execute_model(step(2, [3], cached_reqs=resumed))


def _plant_block_id_past_num_blocks(runner: ModelRunner) -> None:
    runner.input_batch.block_table[0].block_table[0, 0] = runner.kv_cache_config.num_blocks


def _plant_a_parked_copy_of_a_running_request(runner: ModelRunner) -> None:
    runner.parked[1] = ParkedRequest(np.array([1, 2], dtype=np.int32), GREEDY)


def _plant_an_empty_parked_request(runner: ModelRunner) -> None:
    runner.parked[7] = ParkedRequest(np.zeros(0, dtype=np.int32), GREEDY)


def _plant_an_id_past_a_row_of_the_block_table(runner: ModelRunner) -> None:
    runner.input_batch.block_table[0].block_table[1, 3] = 5


def _plant_a_row_naming_another_request(runner: ModelRunner) -> None:
    runner.input_batch.handles[0] = 9


def _plant_a_write_into_the_null_block(runner: ModelRunner) -> None:
    next(iter(runner.kv_caches.values()))[0, 1, 2] = 1.0


def _plant_a_cache_of_the_wrong_size(runner: ModelRunner) -> None:
    name, cache = next(iter(runner.kv_caches.items()))
    runner.kv_caches[name] = cache[:-1]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_plant_block_id_past_num_blocks, "group 0 holds block id 16, past num_blocks=16"),
        (_plant_a_parked_copy_of_a_running_request, r"both parked and in the batch: \[1\]"),
        (_plant_an_empty_parked_request, "parked request 7 holds 0 tokens"),
        (_plant_an_id_past_a_row_of_the_block_table, "row 1 holds block id 5 at index 3"),
        (_plant_a_row_naming_another_request, "row 0 names 9, not 1"),
        (_plant_a_write_into_the_null_block, "wrote into the null block"),
        (_plant_a_cache_of_the_wrong_size, r"cache is \(15, 2, 4, .*expected \(16, 2, 4,"),
    ],
)
def test_check_invariants_catches_a_planted_corruption_on_the_next_step(
    corrupt: Callable[[ModelRunner], None], message: str
) -> None:
    runner = make_runner()
    sampled(runner, step(1, [2, 2], new=[new_req(1, [1, 2], [1]), new_req(2, [3, 4], [2])]))
    corrupt(runner)
    with pytest.raises(AssertionError, match=message):
        runner.check_invariants()
    with pytest.raises(AssertionError, match=message):  # check_each_step walks them every step
        runner.execute_model(step(2, []))


@pytest.mark.parametrize("check_invariants", [False, True])
def test_built_runner_checks_each_step_as_the_kv_cache_config_says(check_invariants: bool) -> None:
    config = WorkerConfig(model="checksum", block_size=BLOCK_SIZE, device="cpu")
    groups = get_model_info("checksum", BLOCK_SIZE).kv_cache_groups
    kv_cache_config = KVCacheConfig(8, groups, check_invariants=check_invariants)
    runner = build_model_runner(config, kv_cache_config, single_rank_group(), DEVICE)
    assert runner.check_each_step is check_invariants


def test_greedy_takes_the_first_maximum() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0]], dtype=torch.float64)
    assert Sampler().sample(logits, SampleBatch.one(1, GREEDY, 3)).tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_greedy_tokens_agree_with_torch_argmax_on_ties_nans_and_infinities(
    dtype: torch.dtype,
) -> None:
    nan, inf = math.nan, math.inf
    rows = [[1.0, nan, 3.0, nan], [2.0, 2.0, 1.0, 0.0], [-inf] * 4, [inf, 1.0, inf, nan]]
    generator = torch.Generator().manual_seed(0)
    random_rows = torch.randint(0, 5, (64, 33), generator=generator).tolist()  # many ties
    for values in (rows, random_rows):
        logits = torch.tensor(values, dtype=torch.float64).to(dtype)
        tokens = greedy_tokens(logits)
        assert tokens.dtype == torch.int64
        assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    strided = torch.tensor(random_rows, dtype=torch.float64)[:, ::2]  # not contiguous
    assert torch.equal(greedy_tokens(strided), torch.argmax(strided, dim=-1))


def test_a_mixed_batch_samples_each_row_as_it_would_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.rand((6, 40), generator=generator, dtype=torch.float64) * 4
    params = [GREEDY, SamplingParams(temperature=0.7, seed=11), GREEDY]
    params += [SamplingParams(temperature=1.3), GREEDY, SamplingParams(temperature=2.0, seed=5)]
    handles, positions = [4, 9, 2, 7, 1, 3], [10, 11, 12, 13, 14, 15]
    sampler = Sampler(21)
    together = sampler.sample(logits, SampleBatch(handles, params, positions)).tolist()
    alone = [
        int(sampler.sample(logits[i : i + 1], SampleBatch.one(handles[i], params[i], positions[i])))
        for i in range(6)
    ]
    assert together == alone
    with pytest.raises(ValueError, match="3 handles, 2 sampling params and 3 positions"):
        SampleBatch([1, 2, 3], [GREEDY, GREEDY], [0, 1, 2])
    with pytest.raises(ValueError, match="got 6 logits rows for 1 requests"):
        sampler.sample(logits, SampleBatch.one(1, GREEDY, 0))


def test_seeded_draws_depend_only_on_seed_and_position() -> None:
    assert uniform_draw(7, 100) == uniform_draw(7, 100)
    assert uniform_draw(7, 100) != uniform_draw(7, 101) != uniform_draw(8, 100)
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    picks = [
        int(Sampler().sample(logits, SampleBatch.one(1, params, pos))[0]) for pos in range(2000)
    ]
    again = [
        int(Sampler(99).sample(logits, SampleBatch.one(5, params, pos))[0]) for pos in range(2000)
    ]
    assert picks == again  # the runner seed and the handle do not matter once a seed is given
    assert 0.72 < np.mean(picks) < 0.78  # p(token 1) = 3 / 4


def test_unseeded_draws_differ_between_requests_but_not_between_ranks() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros((1, 64), dtype=torch.float64)

    def draws(runner_seed: int, handle: int) -> list[int]:
        sampler = Sampler(runner_seed)
        return [
            int(sampler.sample(logits, SampleBatch.one(handle, params, p))[0]) for p in range(20)
        ]

    assert draws(0, 1) == draws(0, 1)
    assert draws(0, 1) != draws(0, 2)


def test_input_batch_grows_past_its_first_rows_and_compacts_on_removal() -> None:
    batch = InputBatch(max_model_len=8, block_sizes=[4, 4])
    for handle in range(40):
        row = batch.add_request(
            handle, np.array([handle, handle + 1]), GREEDY, ([handle + 1], [handle + 2])
        )
        assert row == handle
    for handle in range(0, 40, 2):
        parked = batch.remove_request(handle)
        assert parked.token_ids.tolist() == [handle, handle + 1]
        batch.check_invariants()
    assert batch.num_reqs == 20 and sorted(batch.handle_to_row.values()) == list(range(20))
    for handle, row in batch.handle_to_row.items():
        assert batch.token_ids[row, :2].tolist() == [handle, handle + 1]
        assert batch.block_table[1].row(row).tolist() == [handle + 2]
    with pytest.raises(ValueError, match="would hold 9 tokens, more than max_model_len=8"):
        batch.append_token_ids(0, np.arange(7))
