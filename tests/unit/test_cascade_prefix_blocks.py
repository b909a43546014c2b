"""The engine's side of cascade attention: each SchedulerOutput names, per KV-cache group, the
leading blocks that every running request's table shares once the step's blocks are allocated.

A brute-force count over the running requests' tables checks every step, synchronous and
asynchronous, with preemption; and the stand-in workers check that every request a step
schedules holds those blocks in its own table when the step runs.
"""

import random

import msgspec
import pytest
from fake_executor import Harness, MakeHarness

from protocol.bounds import checked_copy
from protocol.buffers import unpack_int32
from protocol.codec import engine_to_worker_decoder
from protocol.errors import ProtocolError
from protocol.kv_cache_spec import FullAttentionSpec
from protocol.worker_messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput

SHARED_PREFIX = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 3 full blocks of 4


def brute_force_count(harness: Harness) -> list[int]:
    """Per group, the leading positions where every running request's table holds one block."""
    scheduler = harness.scheduler
    kv = scheduler.kv_cache_manager
    running = scheduler.running
    if not kv.enable_caching or len(running) < 2:
        return []
    counts = []
    for group_idx, group in enumerate(harness.core.kv_cache_config.kv_cache_groups):
        if not isinstance(group.spec, FullAttentionSpec):
            counts.append(0)
            continue
        tables = [kv.get_block_ids(request.req_id)[group_idx] for request in running]
        num_common = 0
        while all(num_common < len(table) for table in tables) and (
            len({table[num_common] for table in tables}) == 1
        ):
            num_common += 1
        counts.append(num_common)
    return counts


def check_every_step(harness: Harness) -> list[tuple[list[int], list[int]]]:
    """Wrap schedule() and the stand-in workers: (sent, brute-force) counts of every step."""
    scheduler, executor = harness.scheduler, harness.executor
    seen: list[tuple[list[int], list[int]]] = []
    schedule = scheduler.schedule

    def checked_schedule() -> SchedulerOutput:
        output = schedule()
        seen.append((output.num_common_prefix_blocks, brute_force_count(harness)))
        return output

    execute_model = executor.execute_model

    def checked_execute_model(output: SchedulerOutput) -> ModelRunnerOutput:
        reply = execute_model(output)
        handles = list(unpack_int32(reply.handles))
        for group_idx, num_common in enumerate(output.num_common_prefix_blocks):
            tables = [executor.requests[handle].block_ids[group_idx] for handle in handles]
            heads = {tuple(table[:num_common]) for table in tables}
            assert all(len(table) >= num_common for table in tables) and len(heads) <= 1, (
                f"step {output.step_id} names {num_common} common blocks in group {group_idx}, "
                f"the workers' tables start {sorted(heads)}"
            )
        return reply

    scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    executor.execute_model = checked_execute_model  # type: ignore[method-assign]
    return seen


def submit_waves(harness: Harness, num_requests: int, max_tokens: int) -> None:
    """Requests sharing SHARED_PREFIX, submitted a few at a time while earlier ones decode."""
    rng = random.Random(num_requests)
    for idx in range(num_requests):
        tail = [rng.randrange(20, 60) for _ in range(rng.randrange(1, 9))]
        harness.add(f"r{idx}", SHARED_PREFIX + tail, max_tokens=max_tokens)
        if idx % 3 == 2:
            harness.step()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["full", "full+sliding"])
@pytest.mark.parametrize("num_blocks", [96, 30], ids=["roomy", "preempting"])
def test_each_step_names_the_blocks_every_running_request_shares(
    make_harness: MakeHarness, async_scheduling: bool, sliding_window: int | None, num_blocks: int
) -> None:
    harness = make_harness(
        num_blocks=num_blocks,
        max_model_len=40,
        sliding_window=sliding_window,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=24,
    )
    seen = check_every_step(harness)
    submit_waves(harness, num_requests=9, max_tokens=12)
    harness.run()
    for step_idx, (sent, expected) in enumerate(seen):
        assert sent == expected, f"step {step_idx + 1}"
    assert max(sent[0] for sent, _ in seen if sent) == len(SHARED_PREFIX) // 4
    if sliding_window is not None:
        assert all(sent[1] == 0 for sent, _ in seen if sent)
    assert (harness.scheduler.num_preemptions > 0) == (num_blocks == 30)


def test_nothing_is_sent_without_a_prefix_cache_or_with_one_request(
    make_harness: MakeHarness,
) -> None:
    for enable_prefix_caching, num_requests in ((False, 6), (True, 1)):
        harness = make_harness(enable_prefix_caching=enable_prefix_caching)
        seen = check_every_step(harness)
        submit_waves(harness, num_requests, max_tokens=4)
        harness.run()
        assert seen and all(sent == [] for sent, _ in seen)


@pytest.mark.parametrize("counts", [[-1], [0, 2**31]], ids=["negative", "past-int32"])
def test_an_out_of_bounds_count_fails_at_the_decoder(counts: list[int]) -> None:
    step = SchedulerOutput(1, [], CachedRequestData(), b"", 0, [], [], 1, counts)
    with pytest.raises(ProtocolError, match="malformed frame"):
        engine_to_worker_decoder().decode(msgspec.msgpack.encode(step))
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` [<>]= .* at `\$\[9\]"):
        checked_copy(step)
