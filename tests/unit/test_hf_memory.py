"""A checkpoint's memory and dtypes: each rank holds only its slices, `auto` dtypes resolve as
documented, the KV cache may differ from the compute dtype, the CPU budget needs no flag (the
built-in models still do), and the profiling step runs the real model.
"""

import json
from pathlib import Path

import msgspec
import pytest
import torch

from protocol.buffers import pack_int32
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, NewRequestData, SchedulerOutput
from tests.unit.hf_checkpoints import write_checkpoint
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group
from worker.model_runner import build_model_runner
from worker.models.registry import build_model, get_model_info, resolve_dtypes
from worker.profiling import max_usable_blocks, measure_num_blocks, run_profile_step

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(folder, "qwen3", head_dim=32)
    # the hub's spelling of the checkpoint's dtype (transformers 5 writes "dtype")
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_each_rank_reads_only_its_slices(checkpoint: Path) -> None:
    whole = build_model(str(checkpoint), single_rank_group(), CPU)
    whole.check_invariants()
    ranks = run_ranks(2, lambda group: build_model(str(checkpoint), group, CPU))
    replicated = sum(
        t.numel() * t.element_size()
        for t in (whole.weights.embed_tokens, whole.weights.lm_head, whole.weights.final_norm)
    )
    for model in ranks:
        model.check_invariants()
        # everything but the replicated embedding, head and norms is split in half
        assert model.weights_bytes() - replicated < (whole.weights_bytes() - replicated) * 0.55
    # each rank's merged q/k/v starts with its own query heads: together they are the model's
    # (a weight packed for the CPU's GEMM unpacks exactly)
    q_rows = [model.shard.num_heads_per_rank * model.config.head_dim for model in ranks]
    q0, q1 = (
        model.weights.layers[0].qkv_proj.to_dense()[:rows]
        for model, rows in zip(ranks, q_rows, strict=True)
    )
    whole_qkv = whole.weights.layers[0].qkv_proj.to_dense()
    assert torch.equal(torch.cat((q0, q1)), whole_qkv[: sum(q_rows)])


def test_auto_dtypes_resolve_per_device(checkpoint: Path) -> None:
    name = str(checkpoint)
    assert resolve_dtypes(name, "auto", "auto", CPU) == ("float32", "float32")
    assert resolve_dtypes(name, "auto", "auto", torch.device("cuda", 0)) == ("bfloat16", "bfloat16")
    assert resolve_dtypes(name, "float32", "bfloat16", CPU) == ("float32", "bfloat16")
    assert resolve_dtypes("tiny-llama", "auto", "auto", torch.device("cuda", 0)) == (
        "float32",
        "float32",
    )


def one_prefill(num_tokens: int) -> SchedulerOutput:
    prompt = pack_int32(list(range(3, 3 + num_tokens)))
    new = NewRequestData(1, prompt, SamplingParams(max_tokens=1), ([1, 2],), 0)
    return SchedulerOutput(
        1, [new], CachedRequestData(), pack_int32([num_tokens]), num_tokens, [], []
    )


def test_a_bfloat16_kv_cache_under_float32_compute(checkpoint: Path) -> None:
    config = WorkerConfig(
        model=str(checkpoint), dtype="float32", kv_cache_dtype="bfloat16", block_size=4
    )
    info = get_model_info(config.model, 4, "bfloat16")
    runner = build_model_runner(
        config, KVCacheConfig(4, info.kv_cache_groups), single_rank_group(), CPU
    )
    assert {cache.dtype for cache in runner.kv_caches.values()} == {torch.bfloat16}
    assert runner.model.dtype == torch.float32
    runner.execute_model(one_prefill(6))
    runner.check_invariants()


def test_the_cpu_kv_budget_needs_no_flag_for_a_checkpoint(checkpoint: Path) -> None:
    config = WorkerConfig(model=str(checkpoint), device="cpu", block_size=4)
    info = get_model_info(config.model, 4, "float32")
    model = build_model(config.model, single_rank_group(), CPU)
    assert measure_num_blocks(config, info, CPU, None, model, single_rank_group()) >= 2
    fake = WorkerConfig(model="tiny-llama", device="cpu")
    fake_info = get_model_info("tiny-llama", 16)
    fake_model = build_model("tiny-llama", single_rank_group(), CPU)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes is required on device cpu"):
        measure_num_blocks(fake, fake_info, CPU, None, fake_model, single_rank_group())


def test_the_default_cpu_pool_holds_what_the_engine_can_run_and_no_more(checkpoint: Path) -> None:
    """A tiny checkpoint's share of host memory is millions of blocks: the pool stops at the
    blocks max_num_seqs sequences of max_model_len tokens hold, plus the null block."""
    config = WorkerConfig(
        model=str(checkpoint), device="cpu", block_size=4, max_num_seqs=3, max_model_len=10
    )
    info = get_model_info(config.model, 4, "float32")
    model = build_model(config.model, single_rank_group(), CPU)
    num_groups = len(info.kv_cache_groups)
    expected = 3 * num_groups * 3 + 1  # 3 sequences x cdiv(10, 4) blocks in each group
    assert measure_num_blocks(config, info, CPU, None, model, single_rank_group()) == expected
    assert max_usable_blocks(info.kv_cache_groups, 3, 10) == expected
    given = msgspec.structs.replace(config, kv_cache_memory_bytes=1 << 20)  # a budget asked for
    assert measure_num_blocks(given, info, CPU, None, model, single_rank_group()) > expected


def test_the_profiling_step_runs_the_checkpoint(checkpoint: Path) -> None:
    """CUDA capacity comes from this step's peak: it must run the real model at the engine's
    max_num_batched_tokens (here 600 tokens: one 512-token request and one of 88)."""
    info = get_model_info(str(checkpoint), 16, "float32")
    model = build_model(str(checkpoint), single_rank_group(), CPU)
    profile_kv_bytes = run_profile_step(model, info, 0, 1, CPU, 600)
    assert profile_kv_bytes > 0
