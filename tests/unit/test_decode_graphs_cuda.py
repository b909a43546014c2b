"""CUDA graphs of decode steps (worker/graph_runner.py), on any CUDA machine: where every decode
batch fills its bucket, a graphed run gives exactly the eager run's tokens, logits and KV cache;
where batches are padded, exactly the eager forward of the same padded steps, and the unpadded
eager run's tokens. A graphed decode step launches at most MAX_LAUNCHES things, and the graphs'
memory is counted before the KV cache is sized. Skipped without CUDA, and under `--device cpu`,
where the Triton kernels run interpreted (tests/conftest.py); bench/gpu_check.py runs it.
"""

import logging
import os
from pathlib import Path

import pytest
import torch
from lockstep_runners import record_logits, run_in_lockstep

from bench.workload import Workload
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from tests.conftest import TRITON_INTERPRET_ENV
from tests.unit.hf_checkpoints import QWEN3_MIXED_LAYERS, write_checkpoint
from worker.distributed import single_rank_group
from worker.kv_cache import CudaMemory, memory_at_start
from worker.model_runner import ModelRunner, build_model_runner
from worker.models.registry import build_model, get_model_info
from worker.profiling import capture_graph_bytes, measure_num_blocks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get(TRITON_INTERPRET_ENV) == "1",
        reason="Triton kernels run interpreted in this session: run with --device cuda",
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

CUDA = torch.device("cuda")
BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_NUM_SEQS = 4  # buckets 1, 2 and 4
MAX_NUM_BATCHED_TOKENS = 64  # every prompt prefills in the first step
MAX_LAUNCHES = 10  # kernels, copies and graph launches of one graphed decode step (issue 42)
LAUNCH_CALLS = (  # the CUDA runtime and driver calls that put work on a stream
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaGraphLaunch",
)
PROMPTS = [
    [5, 9, 13, 17, 21, 25, 29],
    [7, 11, 15, 19, 23],
    [3, 8, 14, 20, 26, 32, 38, 44, 50],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-mixed")
    write_checkpoint(folder, "qwen3", seed=2, **QWEN3_MIXED_LAYERS)  # full and window groups
    return folder


def worker_config(folder: Path, enforce_eager: bool) -> WorkerConfig:
    return WorkerConfig(
        model=str(folder),
        dtype="float32",
        device="cuda",
        block_size=BLOCK_SIZE,
        attention_backend="triton",
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=enforce_eager,
    )


def cuda_runner(folder: Path, enforce_eager: bool) -> ModelRunner:
    """A runner as the worker builds one: its graphs captured, unless `enforce_eager`."""
    info = get_model_info(str(folder), BLOCK_SIZE)
    kv_cache_config = KVCacheConfig(NUM_BLOCKS, info.kv_cache_groups, check_invariants=True)
    config = worker_config(folder, enforce_eager)
    return build_model_runner(config, kv_cache_config, single_rank_group(), CUDA)


def workload(folder: Path, max_tokens: list[int], logprobs: int | None = 3) -> Workload:
    """One greedy request per entry of `max_tokens`, each asking for `logprobs`."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in max_tokens]
    return Workload(
        str(folder),
        BLOCK_SIZE,
        NUM_BLOCKS,
        PROMPTS[: len(max_tokens)],
        params,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
    )


def test_graphed_decode_steps_equal_eager_ones_exactly(checkpoint: Path) -> None:
    """Batches of 4, 2 and 1 fill their buckets: no padding, the same shapes as eager."""
    graphed, eager = cuda_runner(checkpoint, False), cuda_runner(checkpoint, True)
    assert graphed.graph_runner is not None and eager.graph_runner is None
    assert sorted(graphed.graph_runner.graphs) == [1, 2, 4]
    graphed_logits, eager_logits = record_logits(graphed), record_logits(eager)
    executor = run_in_lockstep(workload(checkpoint, [3, 3, 5, 7]), [graphed, eager])
    assert executor.decode_batches == [4, 4, 2, 2, 1, 1]
    for graphed_out, eager_out in executor.outputs:
        assert graphed_out == eager_out
    for step_idx, (got, expected) in enumerate(zip(graphed_logits, eager_logits, strict=True)):
        assert torch.equal(got, expected), f"step {step_idx + 1}"
    for name, cache in eager.kv_caches.items():
        assert torch.equal(graphed.kv_caches[name], cache), name


def test_padded_replays_equal_the_eager_forward_of_the_padded_steps(checkpoint: Path) -> None:
    """Batches of 3 run as 4: the replay against the same padded step run eagerly (the graph
    runner without its graphs), and against the unpadded eager run, whose GEMMs have another
    row count and may round differently in the last bits."""
    graphed, eager = cuda_runner(checkpoint, False), cuda_runner(checkpoint, True)
    padded_eager = cuda_runner(checkpoint, False)
    assert padded_eager.graph_runner is not None
    padded_eager.graph_runner.graphs.clear()  # its padded decode steps now run eagerly
    runners = [graphed, padded_eager, eager]
    recorded = [record_logits(runner) for runner in runners]
    executor = run_in_lockstep(workload(checkpoint, [3, 4, 6]), runners)
    assert executor.decode_batches == [3, 3, 2, 1, 1]
    for graphed_out, padded_out, eager_out in executor.outputs:
        assert graphed_out == padded_out
        assert graphed_out.sampled_token_ids == eager_out.sampled_token_ids
    for got, padded_expected, expected in zip(*recorded, strict=True):
        assert torch.equal(got, padded_expected)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_graphed_decode_step_launches_at_most_ten_things(checkpoint: Path) -> None:
    """Counted on the host, greedy without logprobs: kernel launches, copies and graph launches
    of each decode step of two requests; one crosses into a new block on the way, so the block
    tables change on some steps and not on others."""
    runner = cuda_runner(checkpoint, False)
    launches = count_launches(runner, workload(checkpoint, [12, 12], logprobs=None))
    assert len(launches) == 11  # prompts of 7 and 5 tokens: the first reaches position 16
    assert max(launches) <= MAX_LAUNCHES, f"launches of each decode step: {launches}"


def count_launches(runner: ModelRunner, work: Workload) -> list[int]:
    """Launch calls of each decode-only step of the workload on `runner`, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    counts: list[int] = []
    execute = runner.execute_model

    def profiled(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.scheduled_new_reqs:  # the prefill step: eager, not counted
            return execute(scheduler_output)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            output = execute(scheduler_output)
            torch.cuda.synchronize()
        names = [event.name for event in profiler.events()]
        counts.append(sum(name in LAUNCH_CALLS for name in names))
        if not counts[-1]:
            raise AssertionError(f"no launch call among the profiled events {sorted(set(names))}")
        return output

    runner.execute_model = profiled  # type: ignore[method-assign]
    run_in_lockstep(work, [runner])
    return counts


def test_graph_memory_is_counted_before_the_kv_cache(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The profiling captures the graphs once on a throwaway runner, and the KV budget leaves
    out the device memory they held."""
    config = worker_config(checkpoint, enforce_eager=False)
    start = memory_at_start(CudaMemory(CUDA))
    model = build_model(
        str(checkpoint), single_rank_group(), CUDA, dtype="float32", attention_backend="triton"
    )
    info = get_model_info(str(checkpoint), BLOCK_SIZE)
    assert capture_graph_bytes(model, info, config, CUDA, CudaMemory(CUDA)) > 0
    with caplog.at_level(logging.INFO, logger="worker.profiling"):
        measure_num_blocks(config, info, CUDA, start, model, single_rank_group())
    (split,) = [
        record.getMessage() for record in caplog.records if "CUDA graphs" in record.getMessage()
    ]
    assert "CUDA graphs 0.000 GiB" not in split, split
