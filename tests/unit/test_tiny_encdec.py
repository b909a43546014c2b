"""tiny-encdec (an encoder whose K/V live in cross-attention blocks, and a decoder) serves exactly
the unpaged reference's tokens: the engine's own Scheduler drives one ModelRunner, with chunked
prefill, prefix caching on and off, and preemption (a resumed request re-encodes into new blocks).
"""

import functools
import random
import threading

import pytest
import torch
from test_tiny_mla import BARRIER_TIMEOUT_S, ThreadedTPGroup

from bench.workload import Workload, build_rank, run_to_completion
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, KVCacheConfig
from protocol.sampling import SamplingParams
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.encoder_inputs import EncoderInputs
from worker.models.registry import get_model_info
from worker.models.tiny_encdec import TINY_ENCDEC, TinyEncDec
from worker.models.tiny_encdec_reference import DenseCrossKV, TinyEncDecReference
from worker.profiling import profile_step_output, run_profile_step

DEVICE = torch.device(worker_test_device())
MODEL = TINY_ENCDEC.name
CROSS_GROUP = 1
PARAMS = [
    SamplingParams(max_tokens=14, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True),  # unseeded: handle-derived
    SamplingParams(max_tokens=12, min_tokens=2, stop_token_ids=[5, 77, 301]),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_requests(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Six prompts of 6..55 tokens, four sharing a prefix of 33 or more, and encoder inputs of
    3..40 tokens: requests 2 and 3 share theirs (a prefix hit), request 5 has another, and
    request 6 repeats request 2's prompt under request 5's input (it may hit 5's prefix only)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    encoders = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 41))] for _ in range(3)]
    prompts = []
    for i in range(5):
        head = shared[: rng.randrange(33, 41)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(6, 16))])
    prompts.append(prompts[1])
    return prompts, [encoders[2], encoders[0], encoders[0], encoders[2], encoders[1], encoders[1]]


PROMPTS, ENCODERS = make_requests(seed=3)


@functools.cache
def reference_model() -> TinyEncDecReference:
    return TinyEncDecReference()


@functools.cache
def reference(idx: int) -> list[int]:
    params = PARAMS[idx % len(PARAMS)]
    return reference_model().generate(PROMPTS[idx], ENCODERS[idx], params, handle=idx + 1)


def workload(block_size: int, num_blocks: int, **options: object) -> Workload:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    return Workload(
        MODEL,
        block_size,
        num_blocks,
        PROMPTS,
        params,
        check_invariants=True,
        encoder_prompts=ENCODERS,
        **options,  # type: ignore[arg-type]
    )


def assert_matches_reference(outputs: dict[int, list[int]]) -> None:
    for idx in range(len(PROMPTS)):
        assert outputs[idx + 1] == reference(idx), f"request {idx + 1}"


def test_tiny_encdec_has_a_self_attention_and_a_cross_attention_group() -> None:
    groups = TINY_ENCDEC.kv_cache_groups(block_size=16, dtype="float32")
    assert [type(group.spec) for group in groups] == [FullAttentionSpec, CrossAttentionSpec]
    assert [group.layer_names for group in groups] == [
        ["layers.0.attn", "layers.1.attn"],
        ["layers.0.cross_attn", "layers.1.cross_attn"],
    ]
    assert groups[CROSS_GROUP].spec.max_num_encoder_tokens == 64


def test_the_encoder_input_changes_the_tokens() -> None:
    assert PROMPTS[1] == PROMPTS[-1] and ENCODERS[1] != ENCODERS[-1]
    assert reference(1) != reference(len(PROMPTS) - 1)


@pytest.mark.parametrize(
    ("block_size", "enable_prefix_caching"), [(4, True), (16, False), (32, True)]
)
def test_paged_tokens_equal_reference_with_chunked_prefill(
    block_size: int, enable_prefix_caching: bool
) -> None:
    """12 tokens a step: prompts of up to 45 tokens prefill in several chunks, and only the
    first chunk's step runs the encoder; later chunks read its K/V from the blocks."""
    num_blocks = 1 + len(PROMPTS) * (96 + 64) // block_size  # room for every request at once
    work = workload(
        block_size,
        num_blocks,
        max_num_batched_tokens=12,
        enable_prefix_caching=enable_prefix_caching,
    )
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    outputs = run_to_completion(core)
    executor.runner.check_invariants()
    assert_matches_reference(outputs)
    num_hit_tokens = int(core.get_stats()["prefix_cache_hits"])
    assert (num_hit_tokens > 0) == enable_prefix_caching


@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 40), (16, 12)])
def test_tokens_survive_preemption_and_re_encoding(block_size: int, num_blocks: int) -> None:
    """A pool too small for the batch: preempted requests lose their encoder blocks and resume
    with new ones, into which the worker encodes their input again."""
    work = workload(block_size, num_blocks, max_num_batched_tokens=16)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    outputs = run_to_completion(core)
    executor.runner.check_invariants()
    assert int(core.get_stats()["num_preemptions"]) > 0
    assert_matches_reference(outputs)


def _first_step_then_corrupt(entry: int | None) -> tuple[list[int], dict[int, list[int]]]:
    """Request 1's first token, then the rest after its cross-attention table's block 0 is set
    to `entry` (None: another request's encoder block)."""
    work = Workload(
        MODEL,
        4,
        80,
        PROMPTS[:2],
        [PARAMS[0]] * 2,
        200,
        check_invariants=True,
        encoder_prompts=[ENCODERS[0], ENCODERS[2]],
    )
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    first = [
        token_id
        for client_outputs in core.step().values()
        for output in client_outputs.outputs
        if output.req_id == "1"
        for token_id in output.new_token_ids
    ]
    batch = executor.runner.input_batch
    table = batch.block_table[CROSS_GROUP]
    row, other_row = batch.handle_to_row[1], batch.handle_to_row[2]
    table.block_table[row, 0] = table.block_table[other_row, 0] if entry is None else entry
    return first, run_to_completion(core)


def test_a_corrupted_cross_attention_table_changes_the_tokens() -> None:
    """The decoder reads the encoder K/V only through the cross-attention table."""
    expected = reference_model().generate(PROMPTS[0], ENCODERS[0], PARAMS[0], handle=1)
    first, outputs = _first_step_then_corrupt(None)
    assert first == expected[:1] and first + outputs[1] != expected


def test_a_cross_attention_table_into_the_null_block_is_refused() -> None:
    with pytest.raises(ValueError, match="maps its encoder tokens into the null block"):
        _first_step_then_corrupt(0)


def test_tp2_shards_all_reduce_to_exactly_the_tp1_logits() -> None:
    """Every rank runs the whole encoder and keeps its own cross-attention heads; the
    all-reduced logits of every position are bit-identical to one rank's."""
    tp_size, sequence, encoder = 2, PROMPTS[2], ENCODERS[2]
    tokens = torch.tensor(sequence, dtype=torch.int64)
    positions = torch.arange(len(sequence), dtype=torch.int64)
    every = torch.arange(len(sequence))
    full = TinyEncDec(TINY_ENCDEC, single_rank_group(), 0, DEVICE)
    expected = full.forward(tokens, positions, every, DenseCrossKV(len(sequence), encoder))
    slots: list = [None] * tp_size
    barrier = threading.Barrier(tp_size, timeout=BARRIER_TIMEOUT_S)
    results: list = [None] * tp_size

    def run_rank(rank: int) -> None:
        model = TinyEncDec(TINY_ENCDEC, ThreadedTPGroup(rank, tp_size, slots, barrier), 0, DEVICE)
        kv = DenseCrossKV(len(sequence), encoder)
        results[rank] = model.forward(tokens, positions, every, kv)

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BARRIER_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    for logits in results:
        assert torch.equal(logits, expected)


def test_the_profiling_step_brings_encoder_input_within_its_cross_blocks() -> None:
    """A CUDA rank measures its peak on one dummy step: an encoder-decoder model's dummy requests
    need encoder input (the runner refuses one without), as long as the cross blocks allow."""
    info = get_model_info(MODEL, block_size=16)
    step, _ = profile_step_output(info, max_num_batched_tokens=100)
    lengths = [len(new.encoder_token_ids or b"") // 4 for new in step.scheduled_new_reqs]
    assert lengths == [64]  # one 100-token request, its encoder input at the model's limit
    model = TinyEncDec(TINY_ENCDEC, single_rank_group(), 0, DEVICE)
    assert run_profile_step(model, info, 0, 1, DEVICE, max_num_batched_tokens=100) > 0


def test_the_runner_refuses_encoder_input_that_does_not_fit_its_model() -> None:
    encdec = EncoderInputs(KVCacheConfig(8, TINY_ENCDEC.kv_cache_groups(16, "float32")))
    with pytest.raises(ValueError, match="new request 3 brings encoder_token_ids of None bytes"):
        encdec.add(3, None)
    with pytest.raises(ValueError, match="new request 3 brings encoder_token_ids of 6 bytes"):
        encdec.add(3, b"\x01" * 6)
    decoder_only = EncoderInputs(
        KVCacheConfig(8, TINY_ENCDEC.decoder.kv_cache_groups(16, "float32"))
    )
    with pytest.raises(ValueError, match="the model has no cross-attention layers"):
        decoder_only.add(3, pack_int32([1]))


def test_a_cross_attention_table_missing_blocks_is_refused() -> None:
    """The engine sends every encoder block at admission; a row short of them is a broken step."""
    work = workload(16, 80, max_num_batched_tokens=200)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    core.step()
    batch = executor.runner.input_batch
    batch.block_table[CROSS_GROUP].clear_row(batch.handle_to_row[1])
    with pytest.raises(ValueError, match="holds 0 cross-attention blocks for"):
        core.step()
