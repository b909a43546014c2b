"""The transport benchmark measures the steps it names: a 256-request decode step and an
8 x 2,048-token prefill, each answered the way a rank answers, and round-tripping the codec; its
ratios are medians of per-round ratios against the ZMQ floor and the ring's own floor."""

from bench.transport import (
    NUM_DECODE_REQS,
    NUM_PREFILL_REQS,
    PREFILL_LEN,
    Rounds,
    decode_step,
    figures_from,
    median_ratio,
    prefill_step,
    verdicts,
)
from bench.transport_ranks import reply_for
from engine_core.workers.rank_agreement import describe_disagreement
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


def one_round(floor_s: float, scale: float) -> dict[str, list[float]]:
    """A round whose ZMQ floor is `floor_s`, ring floors (rings both ways) a quarter of it, and
    steps `scale` times it per rank over ZMQ, half that over the ring."""
    samples = {"pingpong": [floor_s], "ring_pingpong": [floor_s / 2]}
    samples["ring_pingpong_asleep"] = [floor_s]
    samples["ring_pingpong_tp2"] = [floor_s]
    samples["shm_pingpong_tp1"] = samples["shm_pingpong_tp2"] = [floor_s / 4]
    for name in ("decode_256", "prefill_8x2048"):
        for tp_size in (1, 2):
            samples[f"{name}_tp{tp_size}"] = [floor_s * scale * tp_size]
            samples[f"ring_{name}_tp{tp_size}"] = [floor_s * scale * tp_size / 2]
    return samples


def test_figures_are_ratios_to_the_floors_measured_alongside() -> None:
    rounds = [one_round(100e-6, 1.5) for _ in range(5)]
    figures = figures_from(rounds, num_iters=10)
    assert figures["ratio_decode_256_tp1_to_floor"] == 1.5
    assert figures["ratio_decode_256_tp2_to_floor"] == 3.0
    assert figures["ratio_ring_decode_256_tp2_to_floor"] == 1.5
    assert figures["ratio_ring_decode_256_tp1_to_floor"] == 0.75
    assert figures["ratio_ring_decode_256_tp2_to_ring_floor"] == 6.0
    assert figures["ratio_ring_decode_256_tp1_to_ring_floor"] == 3.0
    assert figures["ratio_ring_pingpong_to_floor"] == 0.5
    found = verdicts(figures)
    assert found["target_decode_tp1"] == "1.50x floor (target <= 1.5x)"
    assert found["target_ring_decode_tp2"] == "1.50x floor (target <= 1.5x)"
    assert found["target_ring_decode_tp2_own_floor"] == "6.00x ring floor (target <= 2.0x)"


def test_a_ratio_is_the_median_of_per_round_ratios() -> None:
    """A round on a loaded machine slows the floor and the step alike; pooling the samples
    before dividing would mix a slow round's step with a quick round's floor."""
    rounds: Rounds = [one_round(100e-6, 1.5), one_round(200e-6, 1.5), one_round(100e-6, 2.0)]
    assert median_ratio(rounds, "decode_256_tp1", "pingpong") == 1.5
