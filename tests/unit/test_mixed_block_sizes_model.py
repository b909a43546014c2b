"""tiny-llama-hybrid-2x: a model whose window group's blocks are twice the engine's block size.

The engine's Scheduler drives one ModelRunner; requests hash at --block-size (the gcd), the window
group reads them through a view, hits end on the larger block size, and the worker's tables and
slots follow each group's own block size. Tokens must equal the unpaged reference.
"""

import functools

import pytest
import torch
from model_workloads import PARAMS, PROMPTS

from bench.workload import Workload, run_workload
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.models.reference import reference_generate
from worker.models.registry import get_model_info

DEVICE = torch.device(worker_test_device())
MODEL = "tiny-llama-hybrid-2x"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.cache
def reference(prompt_idx: int) -> list[int]:
    params = PARAMS[prompt_idx % len(PARAMS)]
    return reference_generate(MODEL, PROMPTS[prompt_idx], params, handle=prompt_idx + 1)


def _run(block_size: int, num_blocks: int, enable_prefix_caching: bool) -> object:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    work = Workload(
        MODEL,
        block_size,
        num_blocks,
        PROMPTS,
        params,
        check_invariants=True,
        max_num_batched_tokens=24,  # prompts past 24 tokens are chunked
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    for i in range(len(PROMPTS)):
        assert result.outputs[i + 1] == reference(i), f"request {i + 1}"
    return result


def test_the_window_group_uses_twice_the_block_size() -> None:
    groups = get_model_info(MODEL, 4).kv_cache_groups
    assert [group.spec.block_size for group in groups] == [4, 8]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_paged_tokens_equal_reference(block_size: int, enable_prefix_caching: bool) -> None:
    result = _run(block_size, 1 + 4 * 128 // block_size, enable_prefix_caching)
    assert (result.num_hit_tokens > 0) == enable_prefix_caching


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tokens_survive_preemption_and_recompute(enable_prefix_caching: bool) -> None:
    """36 blocks: the longest request (86 tokens) holds 22 full-attention blocks of 4 and
    cdiv(47 + 24, 8) + 1 = 10 window blocks of 8 (the Scheduler admits 33 and up), too few
    for the batch, so requests are preempted and recomputed."""
    result = _run(4, 36, enable_prefix_caching)
    assert result.num_preemptions > 0
