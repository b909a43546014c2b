"""fixed-time is checksum held to a set time: the same tokens through the paged cache, the same
reference, and a forward that never returns before model_step_ms has passed."""

import random
import time

import pytest
import torch

from bench.workload import Workload, run_workload
from deploy.cli import worker_config_from, worker_parser
from deploy.flags import UsageError
from protocol.config import WorkerConfig
from protocol.sampling import SamplingParams
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.models.checksum import CHECKSUM, ChecksumModel
from worker.models.fixed_time import FIXED_TIME, FixedTimeModel
from worker.models.reference import DenseKV, reference_generate
from worker.models.registry import build_model, get_model_info

DEVICE = torch.device(worker_test_device())
PARAMS = [
    SamplingParams(max_tokens=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(count: int) -> list[list[int]]:
    """Prompts of 6..40 tokens; every other one shares a 20-token prefix, so prefix caching hits."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    return [
        (shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(6, 21))]
        for i in range(count)
    ]


def test_served_tokens_equal_the_checksum_reference() -> None:
    """Paged, chunked and prefix-cached through the engine's Scheduler and a ModelRunner."""
    prompts = make_prompts(6)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    work = Workload(
        FIXED_TIME.name, 4, 64, prompts, params, max_num_batched_tokens=16, check_invariants=True
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    assert result.num_hit_tokens > 0
    for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        expected = reference_generate(CHECKSUM.name, prompt, sampling, handle=i + 1)
        assert result.outputs[i + 1] == expected, f"request {i + 1}"
        assert reference_generate(FIXED_TIME.name, prompt, sampling, handle=i + 1) == expected


def test_model_info_differs_from_checksum_only_in_its_name() -> None:
    checksum, fixed_time = get_model_info(CHECKSUM.name, 16), get_model_info(FIXED_TIME.name, 16)
    assert fixed_time.name == "fixed-time"
    assert fixed_time.kv_cache_groups == checksum.kv_cache_groups
    assert (fixed_time.vocab_size, fixed_time.eos_token_id, fixed_time.max_model_len) == (
        checksum.vocab_size,
        checksum.eos_token_id,
        checksum.max_model_len,
    )


class IntegerDenseKV(DenseKV):
    """The reference's unpaged K/V, kept in checksum's int64 rather than float64."""

    def write(self, layer_name: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store[layer_name] = (k, v)


def forward_once(model: object, sequence: list[int]) -> torch.Tensor:
    """One forward over a whole sequence, unpaged, sampling its last position."""
    tokens = torch.tensor(sequence, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(len(sequence), dtype=torch.int64, device=DEVICE)
    last = torch.tensor([len(sequence) - 1], device=DEVICE)
    windows = dict.fromkeys(FIXED_TIME.kv_cache_groups(16)[0].layer_names)
    return model.forward(tokens, positions, last, IntegerDenseKV(len(sequence), windows))  # type: ignore[attr-defined]


def test_a_forward_lasts_at_least_model_step_ms_and_returns_checksums_logits() -> None:
    model = build_model(FIXED_TIME.name, single_rank_group(), DEVICE, model_step_ms=30.0)
    assert isinstance(model, FixedTimeModel)
    model.check_invariants()
    checksum = ChecksumModel(CHECKSUM, single_rank_group(), DEVICE)
    sequence = [3, 14, 15, 92, 65, 35]
    for _ in range(3):
        start_s = time.perf_counter()
        logits = forward_once(model, sequence)
        elapsed_s = time.perf_counter() - start_s
        assert elapsed_s >= 0.030  # a lower bound only: sleep guarantees it, load only adds
        assert torch.equal(logits, forward_once(checksum, sequence))


def test_the_step_time_comes_from_the_worker_config_and_its_flag() -> None:
    assert WorkerConfig().model_step_ms == 5.0
    default = build_model(FIXED_TIME.name, single_rank_group(), DEVICE)
    assert isinstance(default, FixedTimeModel) and default.step_s == 0.005
    args = worker_parser().parse_args(["--model", "fixed-time", "--model-step-ms", "2.5"])
    assert worker_config_from(args, {}).model_step_ms == 2.5
    with pytest.raises(UsageError, match=r"--model-step-ms 0\.0"):
        worker_config_from(worker_parser().parse_args(["--model-step-ms", "0"]), {})
    with pytest.raises(ValueError, match="expected > 0"):
        FixedTimeModel(ChecksumModel(CHECKSUM, single_rank_group(), DEVICE), 0.0)
