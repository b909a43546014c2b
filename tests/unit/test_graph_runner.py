"""Decode graphs' rules, on the CPU: the bucket sizes, which ranks capture, and the padded decode
steps a graph replays, run here eagerly over the step buffers by the Triton kernels under triton's
interpreter. A checkpoint served through the step buffers gives the PagedKV path's logits bit for
bit; padded to the buckets, its tokens are the same (the capture itself needs CUDA:
test_decode_graphs_cuda.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: @triton.jit decides there

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from lockstep_runners import record_logits, run_in_lockstep

from bench.workload import Workload
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from tests.unit.hf_checkpoints import QWEN3_MIXED_LAYERS, write_checkpoint
from worker.attention_backends.triton_backend import TritonBackend
from worker.distributed import TPGroup, single_rank_group
from worker.graph_runner import bucket_for, decode_buckets, graph_refusal, uses_step_buffers
from worker.kv_cache import allocate_kv_caches
from worker.model_runner import ModelRunner
from worker.models.hf.checkpoint import check_checkpoint
from worker.models.hf.decoder import HFDecoder
from worker.models.registry import get_model_info
from worker.step_buffers import StepLimits

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_NUM_SEQS = 4  # buckets 1, 2 and 4: three decoding requests run padded to 4
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [7, 11, 15, 19, 23], [3, 8, 14, 20, 26, 32, 38, 44, 50]]
PARAMS = [  # they finish one by one, so decode batches of 3, 2 and 1 follow each other
    SamplingParams(max_tokens=3, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=4, ignore_eos=True),
    SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("max_decode_batch", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]), (24, None)],
)
def test_buckets_are_1_2_4_then_steps_of_8_up_to_the_largest_decode_batch(
    max_decode_batch: int, expected: list[int] | None
) -> None:
    buckets = decode_buckets(max_decode_batch)
    assert buckets == (expected or [1, 2, 4, 8, 16, 24])
    assert len(decode_buckets(256)) == 3 + 256 // 8 and decode_buckets(256)[-2:] == [248, 256]
    with pytest.raises(ValueError, match="expected at least 1"):
        decode_buckets(0)


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = [1, 2, 4, 8, 16]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(17, buckets) is None


def test_only_a_triton_checkpoint_on_cuda_captures_and_enforce_eager_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as the flags go
    triton = WorkerConfig(model=str(tmp_path), attention_backend="triton")
    one_rank = single_rank_group()
    assert uses_step_buffers(triton, CUDA) and graph_refusal(triton, CUDA, one_rank) is None
    eager = msgspec.structs.replace(triton, enforce_eager=True)
    assert graph_refusal(eager, CUDA, one_rank) == "--enforce-eager"
    assert uses_step_buffers(eager, CUDA)  # eager steps still read the step buffers
    for config, device in (
        (triton, CPU),
        (msgspec.structs.replace(triton, model="tiny-llama"), CUDA),
    ):
        assert not uses_step_buffers(config, device)
        assert "triton on CUDA only" in str(graph_refusal(config, device, one_rank))
    blocks = msgspec.structs.replace(triton, attention_backend="blocks")
    assert not uses_step_buffers(blocks, CUDA)
    two_ranks = TPGroup(0, 2, process_group=object())  # type: ignore[arg-type]
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group: "gloo")
    assert "over gloo" in str(graph_refusal(triton, CUDA, two_ranks))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group: "nccl")
    assert graph_refusal(triton, CUDA, two_ranks) is None
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text('{"architectures": ["MixtralForCausalLM"]}')
    moe_triton = msgspec.structs.replace(triton, model=str(moe))
    assert uses_step_buffers(moe_triton, CUDA)
    assert "mixture of experts" in str(graph_refusal(moe_triton, CUDA, one_rank))


def triton_runner(folder: Path, with_buffers: bool, buckets: list[int] | None) -> ModelRunner:
    """A runner of the checkpoint whose attention runs the (interpreted) Triton kernels."""
    model = HFDecoder(
        check_checkpoint(str(folder), 1), single_rank_group(), CPU, torch.float32, TritonBackend
    )
    info = get_model_info(str(folder), BLOCK_SIZE)
    kv_cache_config = KVCacheConfig(NUM_BLOCKS, info.kv_cache_groups)
    runner = ModelRunner(
        model,
        kv_cache_config,
        allocate_kv_caches(kv_cache_config, 1, CPU),
        0,
        info.max_model_len,
        CPU,
        check_each_step=True,  # the null block stays unwritten: a padded token wrote nowhere
        enable_cascade_attention=False,
        step_limits=StepLimits(32, MAX_NUM_SEQS) if with_buffers else None,
    )
    if buckets is not None:
        runner.enable_decode_graphs(buckets)
    return runner


def test_steps_through_the_buffers_give_the_paged_path_s_logits_and_padding_its_tokens(
    tmp_path: Path,
) -> None:
    write_checkpoint(tmp_path, "qwen3", seed=2, **QWEN3_MIXED_LAYERS)  # full and window groups
    paged = triton_runner(tmp_path, with_buffers=False, buckets=None)
    buffered = triton_runner(tmp_path, with_buffers=True, buckets=None)
    padded = triton_runner(tmp_path, with_buffers=True, buckets=[1, 2, 4])
    recorded = [record_logits(runner) for runner in (paged, buffered, padded)]
    work = Workload(
        str(tmp_path), BLOCK_SIZE, NUM_BLOCKS, PROMPTS, PARAMS, max_num_seqs=MAX_NUM_SEQS
    )
    executor = run_in_lockstep(work, [paged, buffered, padded])
    assert executor.decode_batches == [3, 3, 2, 1, 1]
    for paged_out, buffered_out, padded_out in executor.outputs:
        assert buffered_out == paged_out
        assert padded_out.sampled_token_ids == paged_out.sampled_token_ids
        assert padded_out.logprob_token_ids == paged_out.logprob_token_ids
        expected = np.frombuffer(paged_out.logprobs, np.float32)
        np.testing.assert_allclose(np.frombuffer(padded_out.logprobs, np.float32), expected, 1e-5)
    for paged_logits, buffered_logits, padded_logits in zip(*recorded, strict=True):
        assert torch.equal(buffered_logits, paged_logits)
        torch.testing.assert_close(padded_logits, paged_logits, rtol=1e-5, atol=1e-5)
    for name, cache in paged.kv_caches.items():
        assert torch.equal(buffered.kv_caches[name], cache)
        torch.testing.assert_close(padded.kv_caches[name], cache, rtol=1e-5, atol=1e-5)
