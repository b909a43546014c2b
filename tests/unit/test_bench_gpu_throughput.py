"""The GPU throughput workloads (bench/gpu_throughput.py) and their figures' arithmetic
(bench/step_records.py), on the CPU: the workloads drawn, the bandwidth floor, kernel counting,
and a whole serve of a tiny checkpoint through the same path the GPU check takes, recorded step
by step, with the fallback from an attention backend that fails; and bench.gpu_check's flags for
them, and its SKIP lines where there is no CUDA.
"""

import argparse
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.gpu_throughput import (
    NANO_VLLM_LENGTHS,
    ThroughputWorkload,
    describe,
    equal_workload,
    generate_s,
    nano_vllm_workload,
    num_blocks_needed,
    serve,
    serve_or_fall_back,
)
from bench.step_records import (
    StepRecord,
    bandwidth_floor_s,
    count_kernels,
    decode_summary,
    device_bandwidth_bytes_per_s,
    kv_bytes_per_token,
)
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from tests.unit.hf_checkpoints import write_checkpoint

CPU = torch.device("cpu")
VOCAB_SIZE = 256  # the tiny checkpoints'
H100 = "NVIDIA H100 80GB HBM3"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_nano_vllm_workload_is_256_seeded_sequences_of_100_to_1024_tokens_each_way() -> None:
    workload = nano_vllm_workload(VOCAB_SIZE)
    assert workload == nano_vllm_workload(VOCAB_SIZE)  # the same seed draws the same requests
    assert workload != nano_vllm_workload(VOCAB_SIZE, seed=1)
    assert len(workload.prompts) == len(workload.output_lens) == 256
    low, high = NANO_VLLM_LENGTHS
    assert all(low <= len(prompt) <= high for prompt in workload.prompts)
    assert all(low <= n <= high for n in workload.output_lens)
    assert all(3 <= token < VOCAB_SIZE for prompt in workload.prompts for token in prompt)
    first = workload.first(64)
    assert first.prompts == workload.prompts[:64] and first.output_lens == workload.output_lens[:64]


def test_equal_workload_is_64_requests_of_128_tokens_each_way() -> None:
    workload = equal_workload(VOCAB_SIZE)
    assert [len(prompt) for prompt in workload.prompts] == [128] * 64
    assert workload.output_lens == [128] * 64 and workload.num_output_tokens == 64 * 128


def test_every_sequence_gets_its_blocks_and_the_null_block_is_counted() -> None:
    workload = ThroughputWorkload("two", [[5] * 16, [5] * 17], [16, 1])
    assert num_blocks_needed(workload, block_size=16) == 1 + 2 + 2


def test_bandwidth_is_assumed_by_the_card_name_only_for_h100_and_h200() -> None:
    assert device_bandwidth_bytes_per_s(H100) == 3.35e12
    assert device_bandwidth_bytes_per_s("NVIDIA H200") == 4.8e12
    assert device_bandwidth_bytes_per_s("NVIDIA A100-SXM4-80GB") is None


def test_bandwidth_floor_of_a_qwen3_06b_decode_step() -> None:
    """28 layers of 8 KV heads of 128 in bf16: 112 KiB per context position."""
    groups = [
        KVCacheGroupSpec(
            [f"layer.{i}" for i in range(28)], FullAttentionSpec(16, 8, 128, "bfloat16")
        )
    ]
    per_token = kv_bytes_per_token(groups)
    assert per_token == 28 * 2 * 8 * 128 * 2 == 114_688
    # 64 requests at 200 positions each read 1.47 GB of KV beside 1.2 GB of weights
    floor_s = bandwidth_floor_s(1_200_000_000, per_token * 64 * 200, 3.35e12)
    assert floor_s == pytest.approx((1.2e9 + 1_468_006_400) / 3.35e12)


def test_copies_and_memsets_are_not_kernel_launches() -> None:
    names = ["Memcpy HtoD (Pinned -> Device)", "_rms_norm_kernel", "Memset (Device)", "gemv"]
    assert count_kernels(names) == (2, 2)


def test_decode_summary_takes_the_largest_decode_batch_without_the_profiled_step() -> None:
    records = [
        StepRecord(4, 400, 400, 0.050),  # the prefill
        StepRecord(4, 4, 404, 0.010),
        StepRecord(4, 4, 408, 0.030, is_profiled=True),
        StepRecord(4, 4, 412, 0.012),
        StepRecord(4, 4, 416, 0.011),
        StepRecord(2, 2, 210, 0.009),  # two requests finished
        StepRecord(0, 0, 0, 0.001),  # only finished ids
    ]
    summary = decode_summary(records, weight_bytes=1000, kv_per_token=10, bandwidth=1e6)
    assert (summary.batch_size, summary.num_steps) == (4, 3)
    assert (summary.median_s, summary.median_context_tokens) == (0.011, 416)
    ratios = [0.010 / (5040 / 1e6), 0.012 / (5120 / 1e6), 0.011 / (5160 / 1e6)]
    assert summary.median_floor_ratio == pytest.approx(sorted(ratios)[1])
    assert decode_summary(records, 1000, 10, None).median_floor_ratio is None


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(folder, "qwen3", tie_word_embeddings=True)
    return folder


def test_a_serve_records_every_step_and_profiles_one_decode_step(tiny_qwen3: Path) -> None:
    """3 requests of 20 prompt and 7 output tokens: a prefill, then 6 decode steps at batch 3,
    the fifth profiled (after four), then one that only finishes them."""
    workload = ThroughputWorkload("tiny", [[7 + i] * 20 for i in range(3)], [7] * 3)
    run = serve(tiny_qwen3, workload, "blocks", time.perf_counter() + 120, CPU)
    shapes = [(r.num_reqs, r.num_tokens, r.num_context_tokens) for r in run.records]
    decode_shapes = [(3, 3, 3 * (20 + step)) for step in range(1, 7)]
    assert shapes[:7] == [(3, 60, 60), *decode_shapes]
    assert [r.is_profiled for r in run.records[:7]] == [False] * 5 + [True, False]
    assert run.profiled_batch == 3 and run.cuda_event_names == []  # no CUDA events on the CPU
    assert run.num_output_tokens + run.num_profiled_tokens == workload.num_output_tokens
    assert run.num_profiled_tokens == 3 and run.wall_s > 0
    assert run.kv_per_token == 2 * 2 * 2 * 128 * 2  # 2 layers, K and V, 2 KV heads of 128, bf16
    assert run.weight_bytes > 0
    line = describe(
        H100, workload, workload, run, "blocks", generate_s(tiny_qwen3, workload, CPU), []
    )
    assert "decode step at batch 3" in line and "0 kernel launches in a decode step" in line
    assert "x the bandwidth floor on NVIDIA H100" in line and "kvserve/generate() " in line
    assert line.count(f"on {H100}") == 5  # every figure names its card


def test_a_backend_that_fails_falls_back_to_blocks_and_says_why(tiny_qwen3: Path) -> None:
    workload = ThroughputWorkload("tiny", [[9] * 12], [3])
    run, backend = serve_or_fall_back(
        tiny_qwen3, workload, "triton", time.perf_counter() + 120, CPU
    )
    assert backend.startswith("blocks (fell back: triton failed, ValueError: attention backend")
    assert run.num_output_tokens + run.num_profiled_tokens == 3


def test_a_serve_past_its_deadline_stops_with_a_timeout(tiny_qwen3: Path) -> None:
    workload = ThroughputWorkload("tiny", [[9] * 12], [3])
    with pytest.raises(TimeoutError, match="past the workload's budget"):
        serve_or_fall_back(tiny_qwen3, workload, "triton", time.perf_counter() - 1, CPU)


def test_nano_vllm_sequences_is_a_count_of_the_benchmarks_sequences() -> None:
    assert gpu_check.nano_vllm_sequences("64") == 64
    for text in ("0", "257", "-3", "all"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a count from 1 to 256"):
            gpu_check.nano_vllm_sequences(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run every check")
def test_without_cuda_the_gpu_check_skips_the_workloads_too_and_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_check.main(["--nano-vllm-sequences", "8", "--attention-backend", "blocks"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "SKIP throughput-equal-qwen3-0.6b no CUDA device" in "\n".join(lines)
    assert "SKIP throughput-nano-vllm-qwen3-0.6b no CUDA device" in "\n".join(lines)
    assert all(line.startswith("SKIP ") for line in lines[:-1])
