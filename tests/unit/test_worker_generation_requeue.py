"""A lost worker generation mid-run (DESIGN.md §8): the engine requeues every request and a new
generation, with empty KV caches, finishes them with exactly the reference tokens.

The executor here is a real ModelRunner in-process; a fault is a step that raises after it was
scheduled, and the new generation is a fresh ModelRunner over freshly allocated caches.
"""

import random

import msgspec
import pytest
import torch
from in_process_engine import engine_config, model_runner

from engine_core.core import EngineCore
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from worker.models.fake.reference import reference_generate
from worker.models.registry import get_model_info

CPU = torch.device("cpu")
MAX_MODEL_LEN = 96
PARAMS = [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=1.0, ignore_eos=True),  # seeded by its handle
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class LosableGeneration:
    """An executor whose runner is lost at chosen steps; `replace` brings a new generation."""

    def __init__(self, model: str, kv_cache_config: KVCacheConfig, fault_steps: set[int]) -> None:
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.fault_steps = fault_steps
        self.first_step_ids: list[int] = []
        self.replace(1)

    def replace(self, first_step_id: int) -> None:
        config = msgspec.structs.replace(self.kv_cache_config, first_step_id=first_step_id)
        # a new generation's cache is empty: the runner gets freshly allocated caches
        self.runner = model_runner(self.model, config, CPU, MAX_MODEL_LEN)
        self.first_step_ids.append(0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.first_step_ids[-1]:
            self.first_step_ids[-1] = scheduler_output.step_id
        if scheduler_output.step_id in self.fault_steps:
            self.fault_steps.discard(scheduler_output.step_id)
            raise ConnectionError(f"rank lost at step {scheduler_output.step_id}")
        return self.runner.execute_model(scheduler_output)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return [
        (shared[: rng.randrange(8, 40)] if idx % 2 else [])
        + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 20))]
        for idx in range(count)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("model", "block_size"), [("checksum", 4), ("tiny-llama", 16)])
def test_a_new_generation_finishes_every_request_with_the_reference_tokens(
    model: str, block_size: int, async_scheduling: bool
) -> None:
    info = get_model_info(model, block_size)
    kv_cache_config = KVCacheConfig(48 if block_size == 4 else 12, info.kv_cache_groups)
    executor = LosableGeneration(model, kv_cache_config, fault_steps={3, 9, 10})
    config = engine_config(
        block_size,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config, kv_cache_config, info, executor)
    prompts = _prompts(8)
    tokens: dict[str, list[int]] = {}
    for idx, prompt in enumerate(prompts):
        request = EngineCoreRequest(f"r{idx}", pack_int32(prompt), PARAMS[idx % 3], float(idx))
        assert core.add_request(request) is None
        tokens[f"r{idx}"] = []
    scheduler = core.scheduler
    handles = {req_id: request.handle for req_id, request in scheduler.requests.items()}
    num_faults = 0
    for _ in range(1000):
        if not core.has_work():
            break
        try:
            outputs = core.step()
        except ConnectionError:
            num_faults += 1
            core.requeue_for_new_workers()
            core.check_invariants()
            assert not scheduler.running and scheduler.kv_cache_manager.usage == 0.0
            executor.replace(core.next_step_id)
            continue
        for batch in outputs.values():
            for output in batch.outputs:
                assert output.error is None
                tokens[output.req_id].extend(output.new_token_ids)
    assert num_faults == 3
    assert executor.first_step_ids == [1, 4, 10, 11], "step ids never restart"
    assert scheduler.make_stats().prefix_cache.resets == 3
    for idx, prompt in enumerate(prompts):
        expected = reference_generate(
            model, prompt, PARAMS[idx % 3], max_model_len=MAX_MODEL_LEN, handle=handles[f"r{idx}"]
        )
        assert tokens[f"r{idx}"] == expected, f"r{idx}"
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
        kv_cache_config.num_blocks - 1
    )


def test_requeue_keeps_the_running_order_and_forgets_what_the_workers_were_told() -> None:
    info = get_model_info("checksum", 4)
    kv_cache_config = KVCacheConfig(40, info.kv_cache_groups)
    executor = LosableGeneration("checksum", kv_cache_config, fault_steps=set())
    config = engine_config(
        4, check_invariants=False, max_model_len=MAX_MODEL_LEN, async_scheduling=False
    )
    core = EngineCore(config, kv_cache_config, info, executor)
    for idx in range(3):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        request = EngineCoreRequest(f"r{idx}", pack_int32([7, 8, 9, 10 + idx]), params, 0.0)
        core.add_request(request)
    core.step()
    core.step()
    scheduler = core.scheduler
    order = [request.req_id for request in scheduler.running]
    core.requeue_for_new_workers()
    assert [request.req_id for request in scheduler.waiting] == order
    assert all(request.num_tokens_sent == 0 for request in scheduler.requests.values())
    executor.replace(core.next_step_id)
    output = scheduler.schedule()
    resent = [new.handle for new in output.scheduled_new_reqs]
    assert resent == [scheduler.requests[req_id].handle for req_id in order]
    assert not output.scheduled_cached_reqs.resumed_handles and not output.finished_handles


def test_a_requeue_counts_one_preemption_per_running_request() -> None:
    """A lost generation preempts its running requests by recompute through the path a pool
    out of blocks takes, so num_preemptions counts them as the requests' own counts do; a
    request still waiting loses nothing and is not counted."""
    info = get_model_info("checksum", 4)
    kv_cache_config = KVCacheConfig(40, info.kv_cache_groups)
    executor = LosableGeneration("checksum", kv_cache_config, fault_steps=set())
    config = engine_config(
        4,
        check_invariants=False,
        max_num_seqs=2,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=False,
    )
    core = EngineCore(config, kv_cache_config, info, executor)
    for idx in range(3):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{idx}", pack_int32([7, 8, 9, 10 + idx]), params, 0.0))
    core.step()
    core.step()
    scheduler = core.scheduler
    assert [request.req_id for request in scheduler.running] == ["r0", "r1"]
    assert core.get_stats()["num_preemptions"] == 0
    core.requeue_for_new_workers()
    assert core.get_stats()["num_preemptions"] == 2
    assert [scheduler.requests[f"r{idx}"].num_preemptions for idx in range(3)] == [1, 1, 0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_new_generation_keeps_the_prompt_of_a_request_sent_again_whole(
    async_scheduling: bool,
) -> None:
    """After the fault the request goes out with its generated tokens as NewRequestData; its
    R-SWA layer must still see only the real prompt whole, or the tokens change. The fault comes
    after decoding passed prompt + window + a block, so the gap is already freed."""
    info = get_model_info("tiny-local", 4)
    kv_cache_config = KVCacheConfig(200, info.kv_cache_groups)
    executor = LosableGeneration("tiny-local", kv_cache_config, fault_steps={45})
    config = engine_config(
        4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling
    )
    core = EngineCore(config, kv_cache_config, info, executor)
    prompt = list(range(3, 13))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    assert core.add_request(EngineCoreRequest("r0", pack_int32(prompt), params, 0.0)) is None
    handle = core.scheduler.requests["r0"].handle
    tokens: list[int] = []
    num_tokens_at_fault = None
    for _ in range(300):
        if not core.has_work():
            break
        try:
            outputs = core.step()
        except ConnectionError:
            num_tokens_at_fault = len(tokens)
            core.requeue_for_new_workers()
            executor.replace(core.next_step_id)
            continue
        for batch in outputs.values():
            for output in batch.outputs:
                assert output.error is None
                tokens.extend(output.new_token_ids)
    assert num_tokens_at_fault is not None and num_tokens_at_fault > 24 + 4
    expected = reference_generate(
        "tiny-local", prompt, params, max_model_len=MAX_MODEL_LEN, handle=handle
    )
    assert tokens == expected
