"""The profiling step runs max_num_batched_tokens tokens through the real model and runner over a
throwaway cache, split into requests no longer than the model allows."""

import msgspec
import pytest
import torch

from protocol.buffers import unpack_int32
from protocol.kv_cache_spec import bytes_per_block
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.models.registry import build_model, get_model_info
from worker.profiling import profile_lengths, profile_step_output, run_profile_step

DEVICE = torch.device(worker_test_device())

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("num_tokens", "max_model_len", "expected"),
    [(2048, 4096, [2048]), (2048, 1024, [1024, 1024]), (100, 32, [32, 32, 32, 4]), (1, 8, [1])],
)
def test_profile_lengths_add_up_to_the_step_and_fit_the_model(
    num_tokens: int, max_model_len: int, expected: list[int]
) -> None:
    assert profile_lengths(num_tokens, max_model_len) == expected


def test_the_profile_step_gives_each_request_blocks_of_its_own_in_every_group() -> None:
    info = get_model_info("tiny-llama-hybrid", block_size=4)
    step, num_blocks = profile_step_output(info, 20)
    (request,) = step.scheduled_new_reqs
    assert len(unpack_int32(request.prompt_token_ids)) == 20
    assert [ids for ids in request.block_ids] == [list(range(1, 6))] * 2
    assert num_blocks == 6  # the null block and five blocks of four tokens
    assert step.total_num_scheduled_tokens == 20


@pytest.mark.parametrize("model_name", ["checksum", "tiny-llama", "tiny-llama-hybrid"])
def test_the_profile_step_runs_the_model_and_reports_its_cache_bytes(model_name: str) -> None:
    max_len = 24  # a short model keeps the step cheap on the CPU
    info = msgspec.structs.replace(get_model_info(model_name, block_size=16), max_model_len=max_len)
    model = build_model(model_name, single_rank_group(), DEVICE)
    num_tokens = max_len + 10  # two requests: one of max_model_len, one of 10
    profile_kv_bytes = run_profile_step(model, info, 0, 1, DEVICE, num_tokens)
    _, num_blocks = profile_step_output(info, num_tokens)
    assert num_blocks == 1 + 2 + 1  # the null block, then 2 blocks and 1 block
    assert profile_kv_bytes == num_blocks * bytes_per_block(info.kv_cache_groups, 1)
