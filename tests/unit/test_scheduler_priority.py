"""Scheduling policies: admission order and the preemption victim under fcfs and priority."""

import pytest
from fake_executor import Harness, MakeHarness, reference_tokens

from engine_core.sched.queues import FCFSRequestQueue, PriorityRequestQueue
from engine_core.sched.request import Request
from protocol.buffers import unpack_int32
from protocol.sampling import SamplingParams


def test_priority_admits_lowest_priority_value_first_with_arrival_as_tiebreak(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(scheduling_policy="priority")
    arrivals = {"r0": (1, 0.0), "r1": (0, 2.0), "r2": (0, 1.0), "r3": (2, 0.0), "r4": (1, 3.0)}
    for req_id, (priority, arrival_time) in arrivals.items():
        harness.add(req_id, [1, 2, 3], priority=priority, arrival_time=arrival_time, max_tokens=2)
    handles = {req_id: harness.handle(req_id) for req_id in arrivals}
    harness.step()
    admitted = [new.handle for new in harness.scheduler_outputs[0].scheduled_new_reqs]
    assert admitted == [handles[req_id] for req_id in ("r2", "r1", "r0", "r4", "r3")]


def test_fcfs_admits_in_arrival_order_whatever_the_priority(make_harness: MakeHarness) -> None:
    harness = make_harness()
    for idx, priority in enumerate([3, 0, 2]):
        harness.add(f"r{idx}", [1, 2, 3], priority=priority, max_tokens=2)
    harness.step()
    admitted = [new.handle for new in harness.scheduler_outputs[0].scheduled_new_reqs]
    assert admitted == [harness.handle(f"r{idx}") for idx in range(3)]


def _two_requests_in_a_full_pool(
    harness: Harness, first: tuple[int, float], second: tuple[int, float]
) -> tuple[int, int]:
    """Run `a` then `b` (6-token prompts) in a 4-block pool until a decode needs a fifth block."""
    harness.add("a", [1, 2, 3, 4, 5, 6], priority=first[0], arrival_time=first[1], max_tokens=8)
    harness.step()
    harness.add("b", [6, 5, 4, 3, 2, 1], priority=second[0], arrival_time=second[1], max_tokens=8)
    handles = harness.handle("a"), harness.handle("b")
    while not harness.scheduler_outputs[-1].preempted_handles:
        harness.step()
    return handles


@pytest.mark.parametrize(
    ("policy", "first", "second", "victim"),
    [
        ("fcfs", (2, 0.0), (0, 1.0), "b"),  # the last running request
        ("priority", (2, 0.0), (0, 1.0), "a"),  # the largest priority value
        ("priority", (0, 5.0), (0, 1.0), "a"),  # equal priority: the latest arrival
        ("priority", (0, 1.0), (1, 0.0), "b"),
    ],
)
def test_preemption_victim_follows_the_policy(
    make_harness: MakeHarness,
    policy: str,
    first: tuple[int, float],
    second: tuple[int, float],
    victim: str,
) -> None:
    harness = make_harness(num_blocks=5, block_size=4, max_model_len=16, scheduling_policy=policy)
    handles = dict(zip("ab", _two_requests_in_a_full_pool(harness, first, second), strict=True))
    preempting = harness.scheduler_outputs[-1]
    assert preempting.preempted_handles == [handles[victim]]
    assert not preempting.scheduled_new_reqs
    # The survivor still runs in the step that preempted, even when the victim came first.
    survivor = "a" if victim == "b" else "b"
    assert list(unpack_int32(preempting.scheduled_cached_reqs.handles)) == [handles[survivor]]
    harness.run()
    for req_id, prompt in (("a", [1, 2, 3, 4, 5, 6]), ("b", [6, 5, 4, 3, 2, 1])):
        assert harness.tokens[req_id] == reference_tokens(prompt, 8, harness.vocab_size)
    assert harness.scheduler.requests == {}


def test_queues_pop_in_policy_order_and_forget_removed_requests() -> None:
    requests = [
        Request(
            f"r{idx}", [1], SamplingParams(), arrival_time=arrival, priority=priority, handle=idx
        )
        for idx, (priority, arrival) in enumerate([(1, 0.0), (0, 2.0), (0, 1.0), (1, 0.0)])
    ]
    fcfs, by_priority = FCFSRequestQueue(), PriorityRequestQueue()
    for request in requests:
        fcfs.add_request(request)
        by_priority.add_request(request)
    for queue in (fcfs, by_priority):
        queue.remove_requests([requests[3]])
        queue.check_invariants()
    assert list(fcfs) == requests[:3]
    assert [by_priority.pop_request() for _ in range(3)] == [requests[2], requests[1], requests[0]]
    fcfs.prepend_request(requests[3])
    assert fcfs.peek_request() is requests[3] and len(fcfs) == 4
    with pytest.raises(IndexError, match="empty waiting queue"):
        by_priority.pop_request()


def test_a_victim_unscheduled_from_the_step_leaves_no_unwritten_block_in_the_prefix_cache(
    make_harness: MakeHarness,
) -> None:
    """Priority preemption may pick a request scheduled earlier in the same step. The block its
    chunk filled was cached when allocated, but that chunk never runs: a later lookup must not
    hit it, or the request (or a twin) would read K/V no rank wrote."""
    harness = make_harness(
        num_blocks=6,
        block_size=4,
        max_model_len=20,
        scheduling_policy="priority",
        long_prefill_token_threshold=4,
    )
    prompt = list(range(1, 14))  # 13 tokens: 4 blocks, reserved whole at admission
    harness.add("a", prompt, priority=1, arrival_time=0.0, max_tokens=4)
    harness.step()  # a computes [0, 4)
    harness.add("b", [9, 8, 7, 6], priority=0, arrival_time=1.0, max_tokens=4)
    harness.step()  # a computes [4, 8); b its prompt, filling the pool
    assert harness.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    harness.step()  # a's chunk [8, 12) is planned, then b's decode needs a block: a is the victim
    preempting = harness.scheduler_outputs[-1]
    assert preempting.preempted_handles == [harness.handle("a")]
    assert list(unpack_int32(preempting.scheduled_cached_reqs.handles)) == [harness.handle("b")]
    kv = harness.scheduler.kv_cache_manager
    _, num_hit_tokens = kv.get_computed_blocks(harness.request("a"))
    assert num_hit_tokens == 8, "only the blocks of chunks that ran may be hit"
    kv.check_invariants()
    harness.run()
    assert harness.tokens["a"] == reference_tokens(prompt, 4, harness.vocab_size)
    assert harness.tokens["b"] == reference_tokens([9, 8, 7, 6], 4, harness.vocab_size)
    harness.check_no_leaks()
