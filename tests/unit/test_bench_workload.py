"""The ModelRunner benchmark's workload, run by the engine's Scheduler at TP=1 in-process: what its
RankResult counts (steps, scheduled tokens, prefix hits, generated tokens by handle) adds up."""

import pytest

from bench.model_runner import make_workload
from bench.workload import RankResult, Workload, run_tensor_parallel
from protocol.sampling import SamplingParams
from worker.models.fake.reference import reference_generate

MAX_TOKENS = 5
PROMPTS = [
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [3, 4, 5],
    [20 + i for i in range(30)],
]
SHARED = list(range(100, 124))  # three full blocks of 8 that each prompt below starts with

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_at_tp1(prompts: list[list[int]], enable_prefix_caching: bool) -> RankResult:
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts)
    work = Workload(
        "checksum",
        block_size=8,
        num_blocks=40,
        prompts=prompts,
        sampling_params=params,
        max_num_batched_tokens=16,  # the 30-token prompt takes two chunked steps
        enable_prefix_caching=enable_prefix_caching,
        check_invariants=True,
    )
    (result,) = run_tensor_parallel(work, 1, timeout_s=60.0)
    return result


def test_result_counts_every_step_and_token_of_the_run() -> None:
    result = run_at_tp1(PROMPTS, enable_prefix_caching=False)
    assert result.rank == 0 and sorted(result.outputs) == [1, 2, 3]  # handles in prompt order
    for handle, prompt in enumerate(PROMPTS, start=1):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        assert result.outputs[handle] == reference_generate("checksum", prompt, params)
    assert result.num_steps == len(result.step_tokens)
    assert max(result.step_tokens) <= 16
    assert result.step_tokens[-1] == 0  # the last step only tells the workers who finished
    # each token is computed once, except the last generated one, which nothing reads back
    assert sum(result.step_tokens) == sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert result.num_preemptions == 0 and result.num_hit_tokens == 0
    assert 0 < result.prepare_s + result.model_s + result.sample_s <= result.runner_s


def test_prefix_hits_are_tokens_the_runner_never_computes() -> None:
    prompts = [[*SHARED, 1, 2], [*SHARED, 5, 6, 7], [*SHARED, 9]]
    result = run_at_tp1(prompts, enable_prefix_caching=True)
    assert result.num_hit_tokens > 0
    total = sum(len(p) + MAX_TOKENS - 1 for p in prompts)
    assert sum(result.step_tokens) + result.num_hit_tokens == total


def test_the_benchmark_workload_runs_at_small_sizes() -> None:
    """Its pool holds exactly its requests; the Scheduler must accept it, however small."""
    (result,) = run_tensor_parallel(make_workload("checksum", 3, 20, 4), 1, timeout_s=60.0)
    assert [len(tokens) for tokens in result.outputs.values()] == [4, 4, 4]
    assert result.num_preemptions == 0 and result.num_hit_tokens == 0
