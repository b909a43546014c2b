"""TP=2 and TP=4 ranks (spawned processes over gloo) sample exactly the tokens of TP=1."""

import dataclasses
import multiprocessing
import random
from collections.abc import Iterator

import pytest

from bench.workload import Workload, run_tensor_parallel
from protocol.sampling import SamplingParams
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

RANKS_TIMEOUT_S = 150.0


@pytest.fixture(autouse=True)
def no_child_left_alive() -> Iterator[None]:
    yield
    assert multiprocessing.active_children() == []


def make_workload(model: str, block_size: int, num_blocks: int) -> Workload:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [
        shared[: rng.randrange(0, 40)]
        + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))]
        for _ in range(5)
    ]
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7),
        SamplingParams(max_tokens=7, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=2.0, ignore_eos=True),
    ]
    return Workload(
        model,
        block_size,
        num_blocks,
        prompts,
        params,
        max_num_batched_tokens=24,
        check_invariants=True,
    )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize(
    ("model", "block_size", "num_blocks"),
    [("checksum", 16, 40), ("tiny-llama", 16, 40), ("tiny-llama-hybrid", 4, 42)],
)
def test_tp_ranks_sample_exactly_the_tokens_of_tp1(
    model: str, block_size: int, num_blocks: int, tp_size: int
) -> None:
    work = make_workload(model, block_size, num_blocks)
    (expected,) = run_tensor_parallel(work, 1, RANKS_TIMEOUT_S)
    results = run_tensor_parallel(work, tp_size, RANKS_TIMEOUT_S)
    assert [r.rank for r in results] == list(range(tp_size))
    for result in results:
        assert result.outputs == expected.outputs, f"rank {result.rank} differs from TP=1"
        assert result.num_steps == expected.num_steps
    if model == "tiny-llama-hybrid":
        assert expected.num_preemptions > 0  # the resumed path ran under TP too
        # Block ids pass between the groups' shared tensors: the tokens stay the unpaged model's.
        requests = zip(work.prompts, work.sampling_params, strict=True)
        for idx, (prompt, params) in enumerate(requests):
            reference = reference_generate(model, prompt, params, handle=idx + 1)
            assert expected.outputs[idx + 1] == reference, f"request {idx + 1}"


FEATURE_PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.9, seed=2, top_k=30, top_p=0.85, ignore_eos=True),
    SamplingParams(max_tokens=6, repetition_penalty=1.3, presence_penalty=0.8, logprobs=3),
    SamplingParams(max_tokens=6, temperature=1.2, min_p=0.05, frequency_penalty=0.7, logprobs=1),
    SamplingParams(max_tokens=7, temperature=0.6, top_k=5, min_tokens=3, stop_token_ids=[5, 77]),
    SamplingParams(max_tokens=5, temperature=2.0, top_p=0.5, ignore_eos=True),  # unseeded
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["checksum", "tiny-llama"])
def test_tp_ranks_draw_filtered_and_penalized_tokens_as_tp1_and_the_reference(model: str) -> None:
    """Filters and penalties run on every rank's identical logits: the draws agree across
    ranks and TP sizes, and equal the unbatched reference's."""
    work = dataclasses.replace(make_workload(model, 16, 40), sampling_params=FEATURE_PARAMS)
    (expected,) = run_tensor_parallel(work, 1, RANKS_TIMEOUT_S)
    for result in run_tensor_parallel(work, 2, RANKS_TIMEOUT_S):
        assert result.outputs == expected.outputs, f"rank {result.rank} differs from TP=1"
    requests = zip(work.prompts, work.sampling_params, strict=True)
    for idx, (prompt, params) in enumerate(requests):
        reference = reference_generate(model, prompt, params, handle=idx + 1)
        assert expected.outputs[idx + 1] == reference, f"request {idx + 1}"


@pytest.mark.timeout(200)
def test_a_rank_that_fails_takes_the_run_down() -> None:
    """tiny-llama's 4 KV heads cannot be split over 3 ranks: every rank fails, none is left."""
    with pytest.raises(RuntimeError, match=r"rank processes .* failed"):
        run_tensor_parallel(make_workload("tiny-llama", 16, 40), 3, RANKS_TIMEOUT_S)
