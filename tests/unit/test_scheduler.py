"""Scheduler scenarios: batching order, budgets, chunked prefill, preemption and resumption."""

import random
from array import array

import pytest
from fake_executor import MakeHarness, reference_tokens

from engine_core.sched.in_flight_step import InFlightStep, StepsInFlight
from engine_core.sched.request import Request
from engine_core.sched.step_plan import StepPlan
from protocol.buffers import pack_int32, unpack_int32
from protocol.sampling import SamplingParams
from protocol.worker_messages import SchedulerOutput


def _prompt(rng: random.Random, length: int, vocab_size: int = 64) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def _num_scheduled(output: SchedulerOutput) -> list[int]:
    return list(unpack_int32(output.num_scheduled_tokens))


def test_ten_requests_are_scheduled_in_one_step_in_arrival_order(make_harness: MakeHarness) -> None:
    harness = make_harness()
    rng = random.Random(0)
    for idx in range(10):
        harness.add(f"r{idx}", _prompt(rng, 5 + idx), max_tokens=3)
    harness.step()
    first = harness.scheduler_outputs[0]
    handles = [new.handle for new in first.scheduled_new_reqs]
    assert handles == sorted(handles) and len(handles) == 10
    assert _num_scheduled(first) == [5 + idx for idx in range(10)]
    assert first.total_num_scheduled_tokens == sum(5 + idx for idx in range(10))
    harness.run()
    for idx in range(10):
        assert len(harness.tokens[f"r{idx}"]) == 3


def test_long_prefills_are_capped_by_threshold_and_budget(make_harness: MakeHarness) -> None:
    harness = make_harness(
        num_blocks=200,
        block_size=16,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=400,
    )
    rng = random.Random(1)
    for idx in range(3):
        harness.add(f"r{idx}", _prompt(rng, 800), max_tokens=2)
    harness.step()
    assert _num_scheduled(harness.scheduler_outputs[0]) == [400, 400, 224]
    harness.step()
    second = harness.scheduler_outputs[1]
    assert _num_scheduled(second) == [400, 400, 224]  # finishing r0, r1; r2 goes on
    harness.run()
    assert all(len(harness.tokens[f"r{idx}"]) == 2 for idx in range(3))


def test_without_chunked_prefill_a_long_prompt_blocks_the_shorter_ones(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(
        max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False
    )
    rng = random.Random(2)
    harness.add("a", _prompt(rng, 40), max_tokens=2)
    harness.add("long", _prompt(rng, 40), max_tokens=2)
    harness.add("short", _prompt(rng, 8), max_tokens=2)
    harness.step()
    first = harness.scheduler_outputs[0]
    assert [new.handle for new in first.scheduled_new_reqs] == [harness.handle("a")]
    assert _num_scheduled(first) == [40]
    harness.step()
    second = harness.scheduler_outputs[1]
    assert [new.handle for new in second.scheduled_new_reqs] == [
        harness.handle("long"),
        harness.handle("short"),
    ]


def test_chunked_prefill_splits_a_prompt_over_steps(make_harness: MakeHarness) -> None:
    harness = make_harness(max_num_batched_tokens=16)
    prompt = _prompt(random.Random(3), 40)
    harness.add("r", prompt, max_tokens=4)
    harness.run()
    assert [_num_scheduled(out) for out in harness.scheduler_outputs[:4]] == [
        [16],
        [16],
        [8],
        [1],
    ]
    assert harness.tokens["r"] == reference_tokens(prompt, 4, harness.vocab_size)


def test_preempted_request_resumes_with_a_replacement_table_and_same_tokens(
    make_harness: MakeHarness,
) -> None:
    rng = random.Random(4)
    prompts = {"first": _prompt(rng, 80), "second": _prompt(rng, 80)}
    harness = make_harness(num_blocks=11, block_size=16, max_model_len=128)
    for req_id, prompt in prompts.items():
        harness.add(req_id, prompt, max_tokens=20)
    harness.run()
    preempting = [out for out in harness.scheduler_outputs if out.preempted_handles]
    assert preempting, "the pool of 11 blocks should force a preemption"
    assert preempting[0].preempted_handles == [2]  # the second request (handle 2) is the victim
    resumed = [
        out for out in harness.scheduler_outputs if out.scheduled_cached_reqs.resumed_handles
    ]
    assert len(resumed) == 1 and resumed[0].scheduled_cached_reqs.resumed_handles == [2]
    cached = resumed[0].scheduled_cached_reqs
    position = list(unpack_int32(cached.handles)).index(2)
    (table,) = cached.new_block_ids[position]
    assert len(table) == 6  # 81 tokens of 16 per block: the whole table, replaced
    for req_id, prompt in prompts.items():
        assert harness.tokens[req_id] == reference_tokens(prompt, 20, harness.vocab_size)


def test_preemption_gives_the_same_tokens_as_a_roomy_pool(make_harness: MakeHarness) -> None:
    rng = random.Random(5)
    prompts = {f"r{idx}": _prompt(rng, rng.randrange(4, 30)) for idx in range(8)}
    tight = make_harness(num_blocks=14, max_model_len=52)
    roomy = make_harness(num_blocks=200, max_model_len=52)
    for harness in (tight, roomy):
        for req_id, prompt in prompts.items():
            harness.add(req_id, prompt, max_tokens=24)
        harness.run()
    assert tight.scheduler.num_preemptions > 0
    assert roomy.scheduler.num_preemptions == 0
    assert tight.tokens == roomy.tokens


def test_no_request_is_admitted_in_a_step_that_preempted(make_harness: MakeHarness) -> None:
    rng = random.Random(6)
    harness = make_harness(num_blocks=9, block_size=4, max_model_len=32)
    harness.add("a", _prompt(rng, 15), max_tokens=16)
    harness.add("b", _prompt(rng, 15), max_tokens=16)
    harness.step()
    harness.add("c", _prompt(rng, 2), max_tokens=2)
    while not any(out.preempted_handles for out in harness.scheduler_outputs):
        harness.step()
    assert not harness.scheduler_outputs[-1].scheduled_new_reqs


def test_abort_in_the_middle_frees_blocks_and_tells_the_workers(make_harness: MakeHarness) -> None:
    rng = random.Random(7)
    harness = make_harness(num_blocks=32, max_model_len=64)
    harness.add("kept", _prompt(rng, 10), max_tokens=8)
    harness.add("aborted", _prompt(rng, 10), max_tokens=50)
    for _ in range(4):
        harness.step()
    free_before = harness.free_blocks()
    handle = harness.handle("aborted")
    harness.abort(["aborted", "unknown"])
    assert harness.free_blocks() == free_before + 4  # 14 tokens in blocks of 4
    assert str(harness.finish_reasons["aborted"]) == "abort"
    harness.step()
    assert harness.scheduler_outputs[-1].finished_handles == [handle]
    harness.run()
    assert len(harness.tokens["kept"]) == 8
    assert len(harness.tokens["aborted"]) == 4


def test_abort_of_a_waiting_request_tells_no_worker(make_harness: MakeHarness) -> None:
    harness = make_harness(max_num_seqs=1)
    harness.add("running", [1, 2, 3], max_tokens=4)
    harness.add("waiting", [4, 5, 6], max_tokens=4)
    harness.step()
    harness.abort(["waiting"])
    harness.run()
    assert all(not out.finished_handles for out in harness.scheduler_outputs[:2])
    assert harness.tokens["waiting"] == []


def test_multi_turn_follow_up_hits_the_cache_for_every_full_block(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(num_blocks=64, block_size=4)
    prompt = _prompt(random.Random(8), 31)
    harness.add("turn-1", prompt, max_tokens=10)
    harness.run()
    assert harness.num_cached_tokens["turn-1"] == 0
    follow_up = prompt + harness.tokens["turn-1"] + [7, 8, 9]
    harness.add("turn-2", follow_up, max_tokens=2)
    harness.run()
    assert harness.num_cached_tokens["turn-2"] == 40  # 31 + 9 computed tokens: 10 full blocks
    first_new = [out for out in harness.scheduler_outputs if out.scheduled_new_reqs][-1]
    assert first_new.scheduled_new_reqs[0].num_computed_tokens == 40
    assert _num_scheduled(first_new) == [4]


@pytest.mark.parametrize("prompt_len", [31, 30])
def test_follow_up_equal_to_prompt_plus_output_hits_all_its_full_blocks(
    make_harness: MakeHarness, prompt_len: int
) -> None:
    """The follow-up is exactly turn 1's prompt and output; every full block of it is a hit.

    With 41 tokens all 10 full blocks hit (40 tokens); with 40 tokens the hit stops at 9 blocks,
    since the last token must be computed for its logits.
    """
    harness = make_harness(num_blocks=64, block_size=4)
    prompt = _prompt(random.Random(12), prompt_len)
    harness.add("turn-1", prompt, max_tokens=10)
    harness.run()
    follow_up = prompt + harness.tokens["turn-1"]
    harness.add("turn-2", follow_up, max_tokens=3)
    harness.run()
    num_full_blocks = len(follow_up) // 4
    expected = 4 * num_full_blocks if len(follow_up) % 4 else 4 * (num_full_blocks - 1)
    assert harness.num_cached_tokens["turn-2"] == expected
    first_new = [out for out in harness.scheduler_outputs if out.scheduled_new_reqs][-1]
    assert _num_scheduled(first_new) == [len(follow_up) - expected]
    assert harness.tokens["turn-2"] == reference_tokens(follow_up, 3, harness.vocab_size)


def test_hybrid_model_gets_one_table_per_group_and_the_same_tokens(
    make_harness: MakeHarness,
) -> None:
    rng = random.Random(9)
    prompts = {f"r{idx}": _prompt(rng, rng.randrange(4, 30)) for idx in range(6)}
    hybrid = make_harness(num_blocks=40, max_model_len=64, sliding_window=8)
    for req_id, prompt in prompts.items():
        hybrid.add(req_id, prompt, max_tokens=20)
    hybrid.run()
    first = hybrid.scheduler_outputs[0].scheduled_new_reqs[0]
    assert len(first.block_ids) == 2
    assert hybrid.scheduler.num_preemptions > 0
    for req_id, prompt in prompts.items():
        assert hybrid.tokens[req_id] == reference_tokens(prompt, 20, hybrid.vocab_size)


@pytest.mark.parametrize("reserve_full_prompt", [True, False])
def test_reserve_full_prompt_admits_only_a_prompt_that_fits_whole(
    make_harness: MakeHarness, reserve_full_prompt: bool
) -> None:
    rng = random.Random(10)
    prompts = {"a": _prompt(rng, 40), "b": _prompt(rng, 40)}
    harness = make_harness(
        num_blocks=17,
        max_model_len=64,
        max_num_batched_tokens=48,
        reserve_full_prompt=reserve_full_prompt,
    )
    for req_id, prompt in prompts.items():
        harness.add(req_id, prompt, max_tokens=8)
    harness.step()
    first = harness.scheduler_outputs[0]
    # a takes 10 of the 16 usable blocks; b's first 8-token chunk fits, its whole prompt does not
    expected = [40, 8] if not reserve_full_prompt else [40]
    assert _num_scheduled(first) == expected
    harness.run()
    for req_id, prompt in prompts.items():
        assert harness.tokens[req_id] == reference_tokens(prompt, 8, harness.vocab_size)


def test_step_plan_invariants_catch_a_request_scheduled_twice() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), handle=1)
    plan = StepPlan()
    plan.new_reqs.append(request)
    plan.new_num_tokens.append(3)
    plan.new_block_ids.append(([1],))
    plan.check_invariants()
    plan.running_reqs.append(request)
    plan.running_num_tokens.append(1)
    plan.running_block_ids.append(None)
    with pytest.raises(AssertionError, match="scheduled twice"):
        plan.check_invariants()


def _fields(request: Request) -> dict[str, object]:
    """Every slot of a request, with lists and arrays copied so later writes show."""
    return {
        name: list(value) if isinstance(value, list | array) else value
        for name in Request.__slots__
        for value in [getattr(request, name)]
    }


def test_building_a_step_plan_changes_no_request() -> None:
    """Guards against the serializer advancing request state: the scheduler advances it once, at
    schedule time, so a second build (a retry, a log, a check) would otherwise skip tokens."""
    new = Request("new", [1, 2, 3, 4, 5], SamplingParams(), handle=1)
    new.num_computed_tokens = 4  # a prefix-cache hit
    running = Request("running", [1, 2, 3], SamplingParams(), handle=2)
    running.num_computed_tokens = running.num_tokens_sent = 3
    running.append_output_token_id(7)  # sampled last step, not yet sent to the workers
    resumed = Request("resumed", [4, 5, 6, 7], SamplingParams(), handle=3)
    resumed.num_tokens_sent = 4  # preempted: the workers hold its tokens, the cache does not
    plan = StepPlan(
        new_reqs=[new],
        new_num_tokens=[1],
        new_block_ids=[([1, 2],)],
        running_reqs=[running],
        running_num_tokens=[1],
        running_block_ids=[None],
        resumed_reqs=[resumed],
        resumed_num_tokens=[4],
        resumed_block_ids=[([3],)],
        preempted_handles=[4],
    )
    before = [_fields(request) for request in plan.requests_in_order()]
    first = plan.build(7, [5])
    assert [_fields(request) for request in plan.requests_in_order()] == before
    assert plan.build(7, [5]) == first
    cached = first.scheduled_cached_reqs
    assert list(unpack_int32(cached.new_token_ids)) == [7]  # only the running request's token
    assert list(unpack_int32(cached.num_computed_tokens)) == [3, 0]
    assert first.scheduled_new_reqs[0].num_computed_tokens == 4


def test_in_flight_step_invariants_catch_handles_that_name_other_requests() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), handle=1)
    message = StepPlan().build(1, [])  # the step's SchedulerOutput: only its step_id is read
    InFlightStep(1, [request], pack_int32([1]), [True], message).check_invariants()
    with pytest.raises(AssertionError, match="handles"):
        InFlightStep(1, [request], pack_int32([2]), [True], message).check_invariants()


def test_steps_in_flight_invariants_catch_a_skipped_step() -> None:
    """The one record of the steps in flight holds consecutive steps, oldest first."""
    request = Request("r", [1, 2, 3], SamplingParams(), handle=1)
    steps_in_flight = StepsInFlight(2)
    for step_id in (1, 3):
        message = StepPlan().build(step_id, [])
        steps_in_flight.add(InFlightStep(step_id, [request], pack_int32([1]), [True], message))
    assert not steps_in_flight.can_add() and steps_in_flight.oldest().step_id == 1
    with pytest.raises(AssertionError, match=r"\[1, 3\] are not consecutive"):
        steps_in_flight.check_invariants()
    steps_in_flight.forget()
    assert len(steps_in_flight) == 0 and steps_in_flight.can_add()


def test_invariants_hold_between_steps_with_two_steps_in_flight(make_harness: MakeHarness) -> None:
    """Asynchronous scheduling: a step may compute the token the step before it will sample, so
    a request's computed tokens pass its known ones, and the invariant check allows exactly that."""
    harness = make_harness(async_scheduling=True)
    harness.add("r", [3] * 5, max_tokens=4)
    harness.step()  # step 1 out
    harness.step()  # step 2 out, step 1 applied, step 3 out: it computes step 2's placeholder
    request = harness.request("r")
    assert (request.num_tokens, request.num_computed_tokens) == (6, 7)
    assert request.num_output_placeholders == 2
    harness.core.check_invariants()
    request.num_computed_tokens += 1  # one past what the steps in flight can have computed
    with pytest.raises(AssertionError, match="2 output placeholders"):
        request.check_invariants()
    request.num_computed_tokens -= 1
    harness.run()
    assert harness.tokens["r"] == reference_tokens([3] * 5, 4, harness.vocab_size)
