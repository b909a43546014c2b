"""What only tiny-encdec (an encoder whose K/V live in cross-attention blocks, and a decoder) has:
its groups, the encoder input's effect, corrupted and short cross-attention tables, the
profiling step and the runner's refusals of bad encoder input.

Its paged tokens (chunked prefill with prefix caching on and off, preemption with re-encoding
into new blocks) are checked with the other models' in test_models_paged_vs_reference.py, its
TP shards in test_models_tp_shards.py.
"""

import pytest
from model_workloads import (
    DEVICE,
    ENCDEC,
    encdec_reference_model,
    first_step_tokens,
    reference,
    workload,
)

from bench.workload import Workload, build_rank, run_to_completion
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import CrossAttentionSpec, FullAttentionSpec, KVCacheConfig
from worker.distributed import single_rank_group
from worker.encoder_inputs import EncoderInputs
from worker.models.fake.tiny_encdec import TINY_ENCDEC, TinyEncDec
from worker.models.registry import get_model_info
from worker.profiling import profile_step_output, run_profile_step

MODEL = TINY_ENCDEC.name
CROSS_GROUP = 1
PROMPTS, ENCODERS, PARAMS = ENCDEC.prompts, ENCDEC.encoders, ENCDEC.params
assert ENCODERS is not None

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    assert reference(MODEL, 1) != reference(MODEL, len(PROMPTS) - 1)


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
    first = first_step_tokens(core)
    batch = executor.runner.input_batch
    table = batch.block_table[CROSS_GROUP]
    row, other_row = batch.handle_to_row[1], batch.handle_to_row[2]
    table.block_table[row, 0] = table.block_table[other_row, 0] if entry is None else entry
    return first, run_to_completion(core)


def test_a_corrupted_cross_attention_table_changes_the_tokens() -> None:
    """The decoder reads the encoder K/V only through the cross-attention table."""
    expected = encdec_reference_model().generate(PROMPTS[0], ENCODERS[0], PARAMS[0], handle=1)
    first, outputs = _first_step_then_corrupt(None)
    assert first == expected[:1] and first + outputs[1] != expected


def test_a_cross_attention_table_into_the_null_block_is_refused() -> None:
    with pytest.raises(ValueError, match="maps its encoder tokens into the null block"):
        _first_step_then_corrupt(0)


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
    work = workload(MODEL, 16, 80, max_num_batched_tokens=200)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    core.step()
    batch = executor.runner.input_batch
    batch.block_table[CROSS_GROUP].clear_row(batch.handle_to_row[1])
    with pytest.raises(ValueError, match="holds 0 cross-attention blocks for"):
        core.step()
