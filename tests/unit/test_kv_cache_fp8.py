"""`--kv-cache-dtype fp8`: a checkpoint's K and V stored as float8 e4m3 (scale 1), one byte each,
so a block holds a quarter of float32's bytes and half of bfloat16's. Both attention backends
that read it agree token for token, greedy tokens match the float32 cache's on these prompts
(e4m3 keeps 3 mantissa bits: the logits move, the argmax rarely does), values past +-448 are
saturated rather than turned into NaN, and what cannot read it is refused before any rank starts.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.workload import run_workload
from deploy.commands import check_model_name
from deploy.flags import UsageError
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    bytes_per_block,
)
from tests.unit.hf_checkpoints import write_checkpoint
from tests.unit.test_hf_generate import PROMPTS, workload
from tests.unit.test_hf_memory import one_prefill
from worker.attention import PagedKV, StepLayout
from worker.block_table import MultiGroupBlockTable
from worker.distributed import single_rank_group
from worker.kv_cache import allocate_kv_caches
from worker.model_runner import build_model_runner
from worker.models.registry import get_model_info, resolve_dtypes

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp8-kv")
    write_checkpoint(folder, "qwen3", seed=1, tie_word_embeddings=True)
    return folder


def test_an_fp8_block_holds_a_quarter_of_float32s_bytes(checkpoint: Path) -> None:
    assert resolve_dtypes(str(checkpoint), "float32", "fp8", CPU) == ("float32", "fp8_e4m3")
    fp8 = get_model_info(str(checkpoint), 4, "fp8_e4m3").kv_cache_groups
    f32 = get_model_info(str(checkpoint), 4, "float32").kv_cache_groups
    assert bytes_per_block(fp8, 1) * 4 == bytes_per_block(f32, 1)
    config = WorkerConfig(model=str(checkpoint), kv_cache_dtype="fp8", block_size=4)
    runner = build_model_runner(config, KVCacheConfig(4, fp8), single_rank_group(), CPU)
    assert {cache.dtype for cache in runner.kv_caches.values()} == {torch.float8_e4m3fn}
    runner.execute_model(one_prefill(6))
    runner.check_invariants()
    written = next(iter(runner.kv_caches.values()))[1:3].float()  # the prompt's two blocks
    assert written.abs().sum() > 0 and torch.isfinite(written).all()


def test_both_backends_read_it_alike_and_greedy_tokens_hold(checkpoint: Path) -> None:
    outputs = {}
    for name, options in {
        "float32": {},
        "blocks": {"kv_cache_dtype": "fp8"},
        "reference": {"kv_cache_dtype": "fp8", "attention_backend": "reference"},
    }.items():
        work = workload(checkpoint, max_num_batched_tokens=12, async_scheduling=True, **options)
        result = run_workload(work, single_rank_group(), CPU)
        assert result.num_hit_tokens > 0
        outputs[name] = result.outputs
    assert outputs["blocks"] == outputs["reference"]
    assert len(outputs["blocks"]) == len(PROMPTS)
    assert outputs["blocks"] == outputs["float32"]


def test_writes_land_as_float8_and_saturate_past_the_range() -> None:
    """PagedKV writes a float8 cache through its bytes (torch's CPU index_copy_ has no float8
    kernel): each token's slot holds K and V rounded to e4m3, and +-1e6 becomes +-448, not NaN."""
    groups = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(BLOCK_SIZE, 2, 4, "fp8_e4m3"))]
    kv_caches = allocate_kv_caches(KVCacheConfig(NUM_BLOCKS, groups), 1, CPU)
    cache = kv_caches["layer.0"]
    assert cache.dtype == torch.float8_e4m3fn
    tables = MultiGroupBlockTable(1, 16, [BLOCK_SIZE])
    tables.add_row(([1, 2],), 0)
    layout = StepLayout(
        rows=np.array([0]),
        first_positions=np.array([0]),
        num_queries=np.array([6]),
        token_offsets=np.array([0]),
        logits_reqs=np.array([0]),
        num_prompt_tokens=np.array([6]),
    )
    paged = PagedKV(kv_caches, KVCacheConfig(NUM_BLOCKS, groups), tables, layout, CPU)
    k = torch.linspace(-3, 3, 6 * 2 * 4).view(6, 2, 4)
    k[0, 0, 0], k[5, 1, 3] = 1e6, -1e6
    paged.write("layer.0", k, -k)
    stored = torch.stack([cache[1 + p // BLOCK_SIZE, 0, p % BLOCK_SIZE] for p in range(6)])
    expected = k.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(stored.float(), expected)
    assert stored.float()[0, 0, 0] == 448 and stored.float()[5, 1, 3] == -448
    assert torch.equal(cache[1, 1, 0].float(), (-expected[0]))
    for chunk in paged.chunks("layer.0"):
        k_ctx, _ = paged.gather("layer.0", chunk)
        assert torch.isfinite(k_ctx.float()).all()


def test_what_cannot_read_it_is_refused(checkpoint: Path) -> None:
    with pytest.raises(UsageError, match="--kv-cache-dtype fp8 with --model tiny-llama"):
        check_model_name(WorkerConfig(model="tiny-llama", kv_cache_dtype="fp8"))
    with pytest.raises(UsageError, match="--attention-backend triton"):
        check_model_name(
            WorkerConfig(model=str(checkpoint), kv_cache_dtype="fp8", attention_backend="triton")
        )
    check_model_name(WorkerConfig(model=str(checkpoint), kv_cache_dtype="fp8"))
