"""Encoder input on the client request: validated like the prompt, refused by decoder-only
models, required by encoder-decoder ones, and carried to the workers with its cross-attention
blocks on admission and again on resume."""

import contextlib
import random

import msgspec
import pytest

from engine_client.request import make_request
from engine_core.sched.request import RequestStatus
from engine_core.sched.scheduler import Scheduler
from engine_core.sched.validation import max_num_encoder_tokens, validate_encoder_tokens
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest, FinishReason
from protocol.codec import client_to_engine_decoder
from protocol.config import CacheConfig, SchedulerConfig
from protocol.errors import ProtocolError
from protocol.kv_cache_spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelInfo, ModelRunnerOutput

BLOCK_SIZE = 4
VOCAB_SIZE = 32
MAX_ENCODER = 8
DIMS = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")
ENCDEC_GROUPS = [
    KVCacheGroupSpec(["self"], FullAttentionSpec(**DIMS)),
    KVCacheGroupSpec(["cross"], CrossAttentionSpec(**DIMS, max_num_encoder_tokens=MAX_ENCODER)),
]


def _request(encoder: bytes | None, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        "r1", pack_int32(prompt or [1, 2]), SamplingParams(), 0.0, encoder_token_ids=encoder
    )


def test_the_model_limit_comes_from_its_cross_attention_group() -> None:
    assert max_num_encoder_tokens(ENCDEC_GROUPS) == MAX_ENCODER
    assert max_num_encoder_tokens(ENCDEC_GROUPS[:1]) is None


@pytest.mark.parametrize(
    ("encoder", "limit", "message"),
    [
        (pack_int32([1]), None, "'r1' brings encoder_token_ids, but the model has no cross-atten"),
        (None, MAX_ENCODER, "'r1' brings no encoder_token_ids: .* expects 1 to 8 encoder tokens"),
        (b"", MAX_ENCODER, "encoder input of 'r1' has 0 tokens: expected 1 to max_num_encoder"),
        (pack_int32([1] * 9), MAX_ENCODER, "has 9 tokens: expected 1 to max_num_encoder_tokens=8"),
        (pack_int32([1, 32]), MAX_ENCODER, "token id 32 in the encoder input of 'r1' is out of"),
        (pack_int32([-1, 3]), MAX_ENCODER, "token id -1 in the encoder input of 'r1' is out of"),
        (b"\x01\x02\x03", MAX_ENCODER, "int32 buffer of 3 bytes is not a multiple of 4"),
    ],
)
def test_bad_encoder_input_is_refused_naming_the_value(
    encoder: bytes | None, limit: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate_encoder_tokens(_request(encoder), limit, VOCAB_SIZE)


def test_good_encoder_input_is_returned_as_int32_ids() -> None:
    ids = validate_encoder_tokens(_request(pack_int32([0, 5, 31])), MAX_ENCODER, VOCAB_SIZE)
    assert ids is not None and list(ids) == [0, 5, 31]
    assert validate_encoder_tokens(_request(None), None, VOCAB_SIZE) is None


def test_the_client_packs_encoder_input_like_the_prompt() -> None:
    request = make_request("r", [1, 2], encoder_token_ids=[7, 8, 9])
    assert request.encoder_token_ids == pack_int32([7, 8, 9])
    assert make_request("r", [1, 2]).encoder_token_ids is None


def _scheduler(num_blocks: int) -> Scheduler:
    info = ModelInfo("encdec", VOCAB_SIZE, [], 64, ENCDEC_GROUPS)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=ENCDEC_GROUPS)
    return Scheduler(
        SchedulerConfig(max_model_len=16, async_scheduling=False),
        CacheConfig(block_size=BLOCK_SIZE),
        config,
        info,
    )


def test_a_decoder_only_request_to_an_encoder_decoder_model_is_rejected() -> None:
    scheduler = _scheduler(num_blocks=16)
    outputs = scheduler.add_request(make_request("r1", [1, 2]), b"c")
    assert outputs is not None
    (output,) = outputs.outputs
    assert output.finish_reason == FinishReason.ERROR
    assert "brings no encoder_token_ids" in (output.error or "")
    assert not scheduler.requests


def test_encoder_input_and_its_blocks_reach_the_workers_on_admission_and_on_resume() -> None:
    # 2 decoder + 2 encoder blocks for "a", 1 + 1 for "b": 6 of the 6 usable blocks.
    scheduler = _scheduler(num_blocks=7)
    assert (
        scheduler.add_request(make_request("a", [1] * 8, encoder_token_ids=[3] * 5), b"c") is None
    )
    assert scheduler.add_request(make_request("b", [2] * 4, encoder_token_ids=[4]), b"c") is None
    first = scheduler.schedule()
    new_a, new_b = first.scheduled_new_reqs
    assert unpack_int32(new_a.encoder_token_ids or b"").tolist() == [3] * 5
    assert new_a.block_ids == ([1, 2], [3, 4])
    assert new_b.block_ids == ([5], [6])
    scheduler.check_invariants()
    # Both sample, and each next token needs a decoder block: "a" asks first, and the last
    # running request ("b") is preempted to make room, its encoder blocks freed with it.
    _answer(scheduler, first, [new_a.handle, new_b.handle])
    second = scheduler.schedule()
    assert second.preempted_handles == [new_b.handle]
    scheduler.check_invariants()
    _answer(scheduler, second, [new_a.handle])
    assert scheduler.kv_cache_manager.get_block_ids(scheduler.waiting.peek_request().req_id) == (
        [],
        [],
    )
    scheduler.finish_requests([scheduler.running[0].req_id], RequestStatus.FINISHED_ABORTED)
    third = scheduler.schedule()  # "b" resumes: a whole new table, encoder blocks included
    cached = third.scheduled_cached_reqs
    assert cached.resumed_handles == [new_b.handle]
    (block_ids,) = cached.new_block_ids
    assert block_ids is not None and [len(ids) for ids in block_ids] == [2, 1]
    scheduler.check_invariants()


def _answer(scheduler: Scheduler, output: object, handles: list[int]) -> None:
    sampled = pack_int32([9] * len(handles))
    reply = ModelRunnerOutput(output.step_id, 0, pack_int32(handles), sampled)  # type: ignore[attr-defined]
    scheduler.update_from_output(output, reply)  # type: ignore[arg-type]


def test_a_malformed_encoder_field_is_a_protocol_error() -> None:
    decoder = client_to_engine_decoder()
    frame = msgspec.to_builtins(_request(pack_int32([1, 2])))
    for bad in ([1, 2], "12", 7):
        with pytest.raises(ProtocolError):
            decoder.decode(msgspec.msgpack.encode({**frame, "encoder_token_ids": bad}))


def test_mutated_encoder_frames_fail_only_at_the_boundary_or_in_validation() -> None:
    """Random byte flips in a request with encoder input: the decoder raises ProtocolError or
    yields a request that validation accepts or refuses with ValueError, never anything else."""
    rng = random.Random(0)
    decoder = client_to_engine_decoder()
    valid = msgspec.msgpack.encode(_request(pack_int32([1, 2, 3, 4])))
    for _ in range(2000):
        frame = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        with contextlib.suppress(ProtocolError):
            request = decoder.decode(bytes(frame[: rng.randrange(1, len(frame) + 1)]))
            if isinstance(request, EngineCoreRequest):
                with contextlib.suppress(ValueError):
                    validate_encoder_tokens(request, MAX_ENCODER, VOCAB_SIZE)


def test_the_demo_refuses_an_encoder_decoder_model_before_starting_anything(
    capsys: pytest.CaptureFixture,
) -> None:
    """Its requests carry no encoder input: every one would be refused."""
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["demo", "--model", "tiny-encdec"])
    assert exited.value.code == 2
    assert "--model tiny-encdec: its requests need encoder input" in capsys.readouterr().err
