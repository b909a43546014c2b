"""Cascade attention in the worker: a prefix every request of a step shares is read once per
layer, and the logits stay bit-identical to reading each request's whole context.

The engine's real Scheduler (prefix caching on) drives two ModelRunners with the same
SchedulerOutputs, one with cascade attention and one without; every step's logits must be equal,
and the tokens equal the dense reference. A count the tables contradict is refused.
"""

import random
from collections.abc import Callable

import pytest
import torch
from in_process_engine import engine_config, model_runner

import worker.cascade as cascade_module
import worker.models.fake.tiny_mla as tiny_mla_module
from engine_core.core import EngineCore
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tests.conftest import worker_test_device
from worker.attention import ContextChunk
from worker.cascade import attend_with_shared_prefix
from worker.model_runner import ModelRunner
from worker.models.fake.reference import reference_generate
from worker.models.registry import get_model_info
from worker.numerics.fixed_point import attend, exp_table, quantize

DEVICE = torch.device(worker_test_device())
MAX_MODEL_LEN = 96
SHARED_PREFIX_LEN = 41
PARAMS = [
    SamplingParams(max_tokens=8, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),  # reads fine logits
    SamplingParams(max_tokens=7, ignore_eos=True),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_runner(
    model: str, kv_cache_config: KVCacheConfig, enable_cascade_attention: bool
) -> ModelRunner:
    info = get_model_info(model, kv_cache_config.kv_cache_groups[0].spec.block_size)
    return model_runner(
        model,
        kv_cache_config,
        DEVICE,
        info.max_model_len,
        enable_cascade_attention=enable_cascade_attention,
    )


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Every logits tensor the runner's model returns, in step order."""
    recorded: list[torch.Tensor] = []
    forward = runner.model.forward

    def recording_forward(*args: object) -> torch.Tensor:
        logits = forward(*args)  # type: ignore[arg-type]
        recorded.append(logits.clone())
        return logits

    runner.model.forward = recording_forward  # type: ignore[method-assign]
    return recorded


class TwoRunners:
    """The engine's executor: runs each step on a cascade runner and a plain one, and checks
    that they sample the same tokens from bit-identical logits."""

    def __init__(self, cascade: ModelRunner, plain: ModelRunner) -> None:
        self.cascade, self.plain = cascade, plain
        self.cascade_logits = record_logits(cascade)
        self.plain_logits = record_logits(plain)
        self.common_prefix_counts: list[list[int]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.common_prefix_counts.append(scheduler_output.num_common_prefix_blocks)
        output = self.cascade.execute_model(scheduler_output)
        plain_output = self.plain.execute_model(scheduler_output)
        assert output.sampled_token_ids == plain_output.sampled_token_ids
        assert len(self.cascade_logits) == len(self.plain_logits)
        if self.cascade_logits:
            assert torch.equal(self.cascade_logits[-1], self.plain_logits[-1]), (
                f"step {scheduler_output.step_id}: cascade logits differ"
            )
        return output


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(SHARED_PREFIX_LEN)]
    return [
        shared + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 12))] for _ in range(count)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("model", "block_size"),
    [
        ("tiny-llama", 4),
        ("tiny-llama", 16),
        ("tiny-llama-hybrid", 4),
        ("tiny-local", 16),
        ("tiny-mla", 4),
        ("tiny-mla", 16),
    ],
)
def test_cascade_gives_the_tokens_and_logits_of_the_plain_path_and_the_reference(
    model: str, block_size: int, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the requests arrive while the first half decode, so their prefills (prefix hit)
    run beside decodes over the shared prefix, and both kinds of query read it once."""
    calls = count_cascade_calls(monkeypatch)
    info = get_model_info(model, block_size)
    kv_cache_config = KVCacheConfig(1 + 12 * 64 // block_size, info.kv_cache_groups)
    executor = TwoRunners(
        make_runner(model, kv_cache_config, True), make_runner(model, kv_cache_config, False)
    )
    config = engine_config(
        block_size,
        max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    core = EngineCore(config, kv_cache_config, info, executor)
    tokens = run(core, prompts(10))
    assert executor.cascade.num_cascade_steps > 0 and calls, "the cascade path never ran"
    assert executor.plain.num_cascade_steps == 0
    shared_blocks = SHARED_PREFIX_LEN // block_size
    assert max(counts[0] for counts in executor.common_prefix_counts if counts) == shared_blocks
    for idx, prompt in enumerate(prompts(10)):
        params = PARAMS[idx % len(PARAMS)]
        expected = reference_generate(
            model, prompt, params, max_model_len=MAX_MODEL_LEN, handle=idx + 1
        )
        assert tokens[idx] == expected, f"request {idx}"


def count_cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the merge every model's cascade path ends in: the number of queries per call."""
    calls: list[int] = []
    real: Callable[..., torch.Tensor] = cascade_module.attend_with_shared_prefix

    def spy(chunks: list[ContextChunk], *args: object) -> torch.Tensor:
        calls.append(sum(chunk.query_idx.numel() for chunk in chunks))
        return real(chunks, *args)

    monkeypatch.setattr(cascade_module, "attend_with_shared_prefix", spy)
    monkeypatch.setattr(tiny_mla_module, "attend_with_shared_prefix", spy)
    return calls


def run(core: EngineCore, all_prompts: list[list[int]]) -> list[list[int]]:
    """Tokens of each prompt; the second half is submitted three steps after the first."""
    tokens: list[list[int]] = [[] for _ in all_prompts]
    half = len(all_prompts) // 2
    for step_idx in range(1000):
        if step_idx in (0, 3):
            first = 0 if step_idx == 0 else half
            for idx in range(first, first + half):
                params = PARAMS[idx % len(PARAMS)]
                prompt = pack_int32(all_prompts[idx])
                assert core.add_request(EngineCoreRequest(str(idx), prompt, params, idx)) is None
        elif not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[int(output.req_id)].extend(output.new_token_ids)
    return tokens


# ---- hand-written steps: the runner checks the engine's counts --------------------------------

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def shared_block_writer() -> SchedulerOutput:
    """Step 1: a request writes block 1 (tokens 5..8) that step 2's two requests then share."""
    new = NewRequestData(9, pack_int32([5, 6, 7, 8, 1]), GREEDY, ([1, 2],), 0)
    return SchedulerOutput(1, [new], CachedRequestData(), pack_int32([5]), 5, [], [])


def two_sharing_requests(
    block_ids: tuple[list[int], list[int]], num_common_prefix_blocks: list[int]
) -> SchedulerOutput:
    """Step 2: two requests whose first 4 tokens (block 1) are already computed (a prefix hit)."""
    prompts = ([5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11])
    new = [
        NewRequestData(idx + 1, pack_int32(prompt), GREEDY, (ids,), 4)
        for idx, (prompt, ids) in enumerate(zip(prompts, block_ids, strict=True))
    ]
    return SchedulerOutput(
        2,
        new,
        CachedRequestData(),
        pack_int32([2, 1]),
        3,
        [9],
        [],
        num_common_prefix_blocks=num_common_prefix_blocks,
    )


def tiny_llama_runner(enable_cascade_attention: bool = True) -> ModelRunner:
    info = get_model_info("tiny-llama", 4)
    runner = make_runner(
        "tiny-llama", KVCacheConfig(16, info.kv_cache_groups), enable_cascade_attention
    )
    runner.execute_model(shared_block_writer())
    return runner


@pytest.mark.parametrize("enable_cascade_attention", [True, False], ids=["on", "off"])
def test_a_right_count_gives_the_tokens_of_no_count(enable_cascade_attention: bool) -> None:
    tokens = []
    for counts in ([1], []):
        runner = tiny_llama_runner(enable_cascade_attention)
        output = runner.execute_model(two_sharing_requests(([1, 3], [1, 4]), counts))
        tokens.append(list(unpack_int32(output.sampled_token_ids)))
        assert runner.num_cascade_steps == int(enable_cascade_attention and bool(counts))
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("enable_cascade_attention", [True, False], ids=["on", "off"])
@pytest.mark.parametrize(
    ("block_ids", "counts", "error"),
    [
        (([1, 3], [2, 4]), [1], "block 0 is 2 in row 1 and 1 in row 0"),
        (([1, 3], [1, 4]), [2], "block 1 is 4 in row 1 and 3 in row 0"),
        (([1, 3], [1, 4]), [3], "the request in row 0 holds 2"),
        (([1, 3], [1, 4]), [1, 0], "names 2 groups, the model has 1"),
    ],
    ids=["other-block", "diverging-tail", "short-table", "group-count"],
)
def test_a_count_the_tables_contradict_is_refused(
    block_ids: tuple[list[int], list[int]],
    counts: list[int],
    error: str,
    enable_cascade_attention: bool,
) -> None:
    """Guards against reading one request's blocks as another's: a wrong count is a clear error
    whether or not cascade attention is on, never silently different tokens."""
    runner = tiny_llama_runner(enable_cascade_attention)
    with pytest.raises(ValueError, match=error):
        runner.execute_model(two_sharing_requests(block_ids, counts))


@pytest.mark.parametrize("seed", range(6))
def test_the_split_softmax_equals_attend_over_the_whole_context(seed: int) -> None:
    """Random grid values, large enough that some weights round to 0 and the max falls in the
    prefix for some queries and in the suffix for others: results are bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs, num_queries, num_heads, num_groups, head_dim = 3, 4, 4, 2, 16
    prefix_len, suffix_len = 5 + seed, 7

    def grid(*shape: int, std: float = 2.0) -> torch.Tensor:
        return quantize(torch.randn(shape, generator=gen, dtype=torch.float64) * std)

    q = grid(num_seqs * num_queries, num_heads, head_dim)  # [T, H, head_dim]
    k_prefix, v_prefix = grid(prefix_len, num_groups, head_dim), grid(prefix_len, num_groups, 16)
    k_suffix = grid(num_seqs, suffix_len, num_groups, head_dim)
    v_suffix = grid(num_seqs, suffix_len, num_groups, head_dim)
    mask = torch.rand((num_seqs, num_queries, suffix_len), generator=gen) < 0.6
    mask[..., 0] = True  # each query reads at least one suffix entry (itself, in a model)
    query_idx = torch.arange(num_seqs * num_queries).view(num_seqs, num_queries)
    zeros = torch.zeros((num_seqs, suffix_len), dtype=torch.int64)
    chunk = ContextChunk(query_idx, zeros, zeros, zeros, mask)
    table = exp_table(torch.device("cpu"))
    merged = attend_with_shared_prefix(
        [chunk], q, k_prefix, v_prefix, lambda _: (k_suffix, v_suffix), table
    )
    whole_mask = torch.cat((torch.ones((num_seqs, num_queries, prefix_len), dtype=bool), mask), -1)
    expected = attend(
        q[query_idx],
        torch.cat((k_prefix.expand(num_seqs, -1, -1, -1), k_suffix), dim=1),
        torch.cat((v_prefix.expand(num_seqs, -1, -1, -1), v_suffix), dim=1),
        whole_mask,
        table,
    )  # [S, n, H * head_dim]
    assert torch.equal(merged, expected.reshape(num_seqs * num_queries, -1))
