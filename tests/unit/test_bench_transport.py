"""The transport benchmark measures the steps it names: a 256-request decode step and an
8 x 2,048-token prefill, each answered the way a rank answers, and round-tripping the codec."""

from bench.transport import (
    NUM_DECODE_REQS,
    NUM_PREFILL_REQS,
    PREFILL_LEN,
    decode_step,
    figures_from,
    prefill_step,
    reply_for,
    verdicts,
)
from engine_core.handshake import describe_disagreement
from protocol.buffers import unpack_int32
from protocol.codec import engine_to_worker_decoder, make_encoder


def test_decode_step_schedules_one_token_for_each_of_256_requests() -> None:
    step = decode_step(3)
    handles = unpack_int32(step.scheduled_cached_reqs.handles)
    assert step.step_id == 3 and not step.scheduled_new_reqs
    assert list(handles) == list(range(1, NUM_DECODE_REQS + 1))
    assert list(unpack_int32(step.num_scheduled_tokens)) == [1] * NUM_DECODE_REQS
    assert step.total_num_scheduled_tokens == NUM_DECODE_REQS


def test_prefill_step_carries_8_prompts_of_2048_tokens() -> None:
    step = prefill_step(1)
    assert len(step.scheduled_new_reqs) == NUM_PREFILL_REQS
    assert all(
        len(unpack_int32(r.prompt_token_ids)) == PREFILL_LEN for r in step.scheduled_new_reqs
    )
    assert step.total_num_scheduled_tokens == NUM_PREFILL_REQS * PREFILL_LEN


def test_steps_round_trip_and_every_rank_replies_alike() -> None:
    encoder, decoder = make_encoder(), engine_to_worker_decoder()
    for step in (decode_step(1), prefill_step(2)):
        assert decoder.decode(encoder.encode(step)) == step
        replies = [reply_for(step, rank) for rank in range(2)]
        num_reqs = len(step.scheduled_new_reqs) + len(
            unpack_int32(step.scheduled_cached_reqs.handles)
        )
        assert all(len(unpack_int32(r.sampled_token_ids)) == num_reqs for r in replies)
        assert describe_disagreement(step.step_id, replies) is None


def test_figures_are_ratios_to_the_floor_measured_alongside() -> None:
    samples = {"pingpong": [100e-6, 100e-6]}
    for name in ("decode_256", "prefill_8x2048"):
        samples[f"{name}_tp1"] = [150e-6]
        samples[f"{name}_tp2"] = [250e-6]
    figures = figures_from(samples, num_iters=10)
    assert figures["ratio_decode_256_tp1_to_floor"] == 1.5
    assert figures["ratio_decode_256_tp2_to_floor"] == 2.5
    assert verdicts(figures)["target_decode_tp1"] == "1.50x floor (target <= 1.5x)"
