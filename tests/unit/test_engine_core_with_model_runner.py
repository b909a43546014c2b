"""The engine's real Scheduler driving a real ModelRunner in-process: tokens equal the reference.

This joins the two halves of the wire contract without sockets: the SchedulerOutputs the engine
builds (prefix hits, chunks, sliding-window null blocks, preemption and resumed tables) must be
read by the worker exactly as meant, or the paged tokens drift from the unpaged reference.
"""

import random

import pytest
import torch
from in_process_engine import engine_config, model_runner

from engine_core.core import EngineCore
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from worker.model_runner import ModelRunner
from worker.models.fake.reference import ReferenceModel, reference_generate
from worker.models.registry import get_model_info

CPU = torch.device("cpu")
MAX_MODEL_LEN = 96
PARAMS = [
    SamplingParams(max_tokens=9, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.8, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(count: int) -> list[list[int]]:
    """Prompts of 8..70 tokens; two in three share a prefix, so the prefix cache hits."""
    rng = random.Random(21)
    shared = [rng.randrange(3, 500) for _ in range(50)]
    return [
        (shared[: rng.randrange(8, 50)] if idx % 3 else [])
        + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 20))]
        for idx in range(count)
    ]


def _engine(
    model: str, block_size: int, num_blocks: int, async_scheduling: bool = False
) -> tuple[EngineCore, ModelRunner]:
    info = get_model_info(model, block_size)
    kv_cache_config = KVCacheConfig(num_blocks, info.kv_cache_groups)
    runner = model_runner(
        model,
        kv_cache_config,
        CPU,
        info.max_model_len,
        eos_token_ids=info.eos_token_ids,  # held back under min_tokens, as the reference does
    )
    config = engine_config(
        block_size,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    return EngineCore(config, kv_cache_config, info, runner), runner


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("model", "block_size", "num_blocks"),
    [("checksum", 4, 40), ("tiny-llama", 16, 8), ("tiny-llama-hybrid", 4, 56)],
)
def test_engine_and_runner_produce_the_reference_tokens(
    model: str, block_size: int, num_blocks: int, async_scheduling: bool
) -> None:
    """Asynchronous scheduling (step N+1 scheduled before step N's tokens are known) gives
    exactly the synchronous loop's tokens, through prefix hits, chunks and preemption."""
    core, runner = _engine(model, block_size, num_blocks, async_scheduling)
    prompts = _prompts(7)
    tokens: dict[str, list[int]] = {}
    for idx, prompt in enumerate(prompts):
        request = EngineCoreRequest(
            f"r{idx}", pack_int32(prompt), PARAMS[idx % len(PARAMS)], float(idx)
        )
        assert core.add_request(request) is None
        tokens[f"r{idx}"] = []
    scheduler = core.scheduler
    handles = {req_id: request.handle for req_id, request in scheduler.requests.items()}
    most_in_flight = 0
    for _ in range(1000):
        if not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
        most_in_flight = max(most_in_flight, scheduler.num_steps_in_flight)
    # between steps the asynchronous loop holds the step the ranks run and the next one behind it
    assert most_in_flight == 2 * async_scheduling, "a step should be sent before its forerunner"
    assert scheduler.num_preemptions > 0, "the pool should force a preemption"
    assert scheduler.make_stats().prefix_cache.hits > 0, "shared prefixes should hit"
    for idx, prompt in enumerate(prompts):
        expected = reference_generate(
            model,
            prompt,
            PARAMS[idx % len(PARAMS)],
            max_model_len=MAX_MODEL_LEN,
            handle=handles[f"r{idx}"],
        )
        assert tokens[f"r{idx}"] == expected, f"r{idx}"
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == num_blocks - 1 and not scheduler.requests
    assert runner.input_batch.num_reqs == 0 and not runner.parked


FEATURE_PARAMS = [
    SamplingParams(
        max_tokens=9, temperature=0.9, seed=7, top_k=20, top_p=0.9, ignore_eos=True, logprobs=2
    ),
    SamplingParams(max_tokens=8, repetition_penalty=1.4, frequency_penalty=0.5, logprobs=0),
    SamplingParams(
        max_tokens=7,
        temperature=1.1,
        seed=3,
        min_p=0.1,
        presence_penalty=1.0,
        stop_token_ids=[5, 77, 301],
        logprobs=4,
    ),
    SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, ignore_eos=True),  # unseeded
]


def _check_logprobs(
    model: ReferenceModel, prompt: list[int], tokens: list[int], entries: list
) -> None:
    """Each entry is the raw log_softmax at its token's position, led by that token, then the
    most likely ids (the fixed-point models tie often: compared by value)."""
    assert len(entries) == len(tokens)
    for idx, (token_id, entry) in enumerate(zip(tokens, entries, strict=True)):
        logits = model.next_token_logits(prompt + tokens[:idx], len(prompt))
        reference = torch.log_softmax(logits, dim=-1)
        ((ids,), (values,), (rank,)) = entry.token_ids, entry.logprobs, entry.sampled_token_ranks
        top_values = torch.sort(reference, descending=True).values[: len(ids) - 1]
        assert ids[0] == token_id and len(set(ids[1:])) == len(ids) - 1
        assert values == pytest.approx(reference[ids].tolist(), rel=1e-6, abs=1e-6)
        assert values[1:] == pytest.approx(top_values.tolist(), rel=1e-6, abs=1e-6)
        assert rank == int((reference > reference[token_id]).sum()) + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("model", "block_size", "num_blocks"), [("checksum", 4, 40), ("tiny-llama", 16, 8)]
)
def test_filters_penalties_and_logprobs_give_the_reference_through_the_engine(
    model: str, block_size: int, num_blocks: int, async_scheduling: bool
) -> None:
    """Seeded draws with filters and penalties are the unbatched reference's whatever the
    batch, chunking or preemption, and every delivered token carries its own raw logprobs."""
    core, _ = _engine(model, block_size, num_blocks, async_scheduling)
    prompts = _prompts(8)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    for idx, prompt in enumerate(prompts):
        params = FEATURE_PARAMS[idx % len(FEATURE_PARAMS)]
        request = EngineCoreRequest(f"r{idx}", pack_int32(prompt), params, float(idx))
        assert core.add_request(request) is None
        tokens[f"r{idx}"], logprobs[f"r{idx}"] = [], []
    scheduler = core.scheduler
    handles = {req_id: request.handle for req_id, request in scheduler.requests.items()}
    for _ in range(1000):
        if not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.req_id].extend(output.new_token_ids)
                if output.new_logprobs is not None:
                    logprobs[output.req_id].append(output.new_logprobs)
    assert scheduler.num_preemptions > 0, "the pool should force a preemption"
    reference = ReferenceModel(model)
    for idx, prompt in enumerate(prompts):
        req_id, params = f"r{idx}", FEATURE_PARAMS[idx % len(FEATURE_PARAMS)]
        expected = reference.generate(
            prompt, params, max_model_len=MAX_MODEL_LEN, handle=handles[req_id]
        )
        assert tokens[req_id] == expected, req_id
        if params.logprobs is None:
            assert not logprobs[req_id], req_id
        else:
            _check_logprobs(reference, prompt, tokens[req_id], logprobs[req_id])
