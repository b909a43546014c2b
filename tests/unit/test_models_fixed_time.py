"""fixed-time is checksum on a device timeline: the same tokens through the paged cache (its sums
taken a block at a time), the same reference, and each forward's output ready model_step_ms after
the later of its call and the previous forward's end."""

import random
import time

import pytest
import torch

from bench.workload import Workload, build_rank, run_to_completion, run_workload
from deploy.cli import worker_config_from, worker_parser
from deploy.flags import UsageError
from protocol.config import WorkerConfig
from protocol.sampling import SamplingParams
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.models.fake.checksum import CHECKSUM, ChecksumModel, LogitMixer, mix_logits
from worker.models.fake.fixed_time import FIXED_TIME, FixedTimeModel
from worker.models.fake.reference import DenseKV, reference_generate
from worker.models.registry import build_model, get_model_info
from worker.sampler import splitmix64

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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_sums_give_checksums_tokens_when_blocks_are_freed_preempted_and_reused(
    async_scheduling: bool,
) -> None:
    """A pool too small for the batch: requests are preempted and recomputed, and freed blocks
    are rewritten at other positions, so stale slot sums must be replaced, never added to."""
    prompts = make_prompts(8)
    params = [
        SamplingParams(max_tokens=12 + i, ignore_eos=True, seed=i, temperature=0.5 * (i % 2))
        for i in range(len(prompts))
    ]
    work = Workload(
        FIXED_TIME.name,
        4,
        24,
        prompts,
        params,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        check_invariants=True,
        async_scheduling=async_scheduling,
    )
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    outputs = run_to_completion(core)
    assert core.get_stats()["num_preemptions"] > 0
    model = executor.runner.model
    assert isinstance(model, FixedTimeModel)
    model.check_invariants()  # every block's sum is its slots'
    for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        assert outputs[i + 1] == reference_generate(CHECKSUM.name, prompt, sampling, handle=i + 1)


@pytest.mark.parametrize("block_idx", [0, 1, 2])
def test_each_table_entry_it_reads_changes_the_tokens_when_corrupted(block_idx: int) -> None:
    """Its sums go through the block table: a full block's (0, 1) and the last token's own
    block's (2) entry, pointed at another request's block, give other tokens."""
    rng = random.Random(block_idx)
    prompts = [[rng.randrange(3, 500) for _ in range(10)] for _ in range(2)]  # blocks 0, 1, 2
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    work = Workload(FIXED_TIME.name, 4, 40, prompts, params, 64, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    first_step = core.step()  # both prefills whole, each with its first token
    first = {
        out.req_id: list(out.new_token_ids) for outs in first_step.values() for out in outs.outputs
    }
    expected = reference_generate(CHECKSUM.name, prompts[0], params[0], handle=1)
    assert first["1"] == expected[:1]
    batch = executor.runner.input_batch
    table = batch.block_table[0]
    row, other = batch.handle_to_row[1], batch.handle_to_row[2]
    table.block_table[row, block_idx] = table.block_table[other, block_idx]
    assert run_to_completion(core)[1] != expected[1:]


def test_model_info_differs_from_checksum_only_in_its_name() -> None:
    checksum, fixed_time = get_model_info(CHECKSUM.name, 16), get_model_info(FIXED_TIME.name, 16)
    assert fixed_time.name == "fixed-time"
    assert fixed_time.kv_cache_groups == checksum.kv_cache_groups
    assert (fixed_time.vocab_size, fixed_time.eos_token_ids, fixed_time.max_model_len) == (
        checksum.vocab_size,
        checksum.eos_token_ids,
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


def test_forwards_take_model_step_ms_each_on_a_device_timeline_with_checksums_logits() -> None:
    """A forward returns at once with checksum's logits; its output is ready step_s after the
    later of its call and the previous forward's end, as a GPU queues a host's forwards."""
    model = build_model(FIXED_TIME.name, single_rank_group(), DEVICE, model_step_ms=30.0)
    assert isinstance(model, FixedTimeModel)
    model.check_invariants()
    checksum = ChecksumModel(CHECKSUM, single_rank_group(), DEVICE)
    sequence = [3, 14, 15, 92, 65, 35]
    start_s = time.perf_counter()
    for i in range(3):  # queued back to back: each starts when the one before it ends
        assert torch.equal(forward_once(model, sequence), forward_once(checksum, sequence))
        assert model.ready_at_s >= start_s + 0.030 * (i + 1)
        assert model.ready_at_s <= time.perf_counter() + 0.030 * (i + 1)
    time.sleep(0.1)  # the device went idle: the next forward starts at its call
    called_s = time.perf_counter()
    forward_once(model, sequence)
    assert called_s + 0.030 <= model.ready_at_s <= time.perf_counter() + 0.030


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


def test_the_logit_mixer_reuses_its_buffers_and_gives_the_formulas_logits() -> None:
    """Batches that grow, shrink and grow again through one mixer, on numpy's path and torch's,
    against the formula in Python integers; extreme totals included (negative, int64 bounds)."""
    mask = (1 << 64) - 1
    columns = [splitmix64(v) | 1 for v in range(CHECKSUM.vocab_size)]
    mixers = [LogitMixer(CHECKSUM.vocab_size), LogitMixer(CHECKSUM.vocab_size, numpy_on_cpu=False)]
    generator = torch.Generator().manual_seed(7)
    for num_rows in (3, 64, 1, 200, 64):
        totals = torch.randint(-(2**62), 2**62, (num_rows,), generator=generator)
        totals[0] = 2**63 - 1
        totals[-1] = -(2**63)
        rows = [splitmix64(total & mask) | 1 for total in totals.tolist()]
        expected = (
            torch.tensor(
                [[(row * column & mask) >> 12 for column in columns] for row in rows],
                dtype=torch.float64,
            )
            / 2**52
        )
        for mixer in mixers:
            assert torch.equal(mixer.mix(totals), expected)
        assert torch.equal(mix_logits(totals, CHECKSUM.vocab_size), expected)
    tokens = mix_logits(torch.arange(4096), CHECKSUM.vocab_size).argmax(dim=1)
    assert len(set(tokens.tolist())) > CHECKSUM.vocab_size // 2  # consecutive totals spread


def test_a_prefill_costs_its_prompt_tokens_and_a_decode_the_step_alone() -> None:
    """With --model-prefill-token-us, a forward's device time grows by that much per token it
    computes and does not sample from: the prompt of a prefill, nothing for a decode. Tokens stay
    checksum's, whatever the charge."""
    args = ["--model", "fixed-time", "--model-prefill-token-us", "2000"]
    config = worker_config_from(worker_parser().parse_args(args), {})
    assert config.model_prefill_token_us == 2000.0
    model = build_model(
        FIXED_TIME.name,
        single_rank_group(),
        DEVICE,
        model_step_ms=10.0,
        model_prefill_token_us=config.model_prefill_token_us,
    )
    assert isinstance(model, FixedTimeModel) and model.prefill_token_s == 0.002
    checksum = ChecksumModel(CHECKSUM, single_rank_group(), DEVICE)
    sequence = [3, 14, 15, 92, 65, 35]  # five tokens computed without sampling, one sampled
    called_s = time.perf_counter()
    assert torch.equal(forward_once(model, sequence), forward_once(checksum, sequence))
    assert called_s + 0.010 + 5 * 0.002 <= model.ready_at_s
    assert model.ready_at_s <= time.perf_counter() + 0.010 + 5 * 0.002
    time.sleep(0.05)  # idle again: a one-token forward (a decode) costs the step alone
    called_s = time.perf_counter()
    forward_once(model, sequence[:1])
    assert called_s + 0.010 <= model.ready_at_s <= time.perf_counter() + 0.010
    with pytest.raises(UsageError, match=r"--model-prefill-token-us -1\.0"):
        worker_config_from(worker_parser().parse_args(["--model-prefill-token-us", "-1"]), {})
