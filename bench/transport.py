"""Per-step round trip of the engine-worker transport, over ZeroMQ and over the shared-memory ring.

A 256-request decode step and an 8 x 2,048-token prefill go to 1 and 2 rank processes through the
engine's own `WorkerGroup.execute_model`, with the ring off (ZMQ both ways) and on (steps over the
ring, replies in each rank's lane of it), interleaved with the floors of bench/transport_floors.py:
the 1-byte ZMQ ping-pong, and the ring's own floor, a 1-byte round trip over rings both ways to as
many ranks (`shm_roundtrip_*`). python -m bench.transport
"""

import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable

import zmq

from bench.report import base_parser, report
from bench.transport_floors import PingPong, ShmPingPong
from bench.transport_ranks import (
    BLOCK_SIZE,
    GROUPS,
    HANDSHAKE_TIMEOUT_S,
    STEP_TIMEOUT_S,
    rank_main,
)
from engine_core.workers.worker_group import WorkerGroup
from protocol.buffers import pack_int32
from protocol.codec import engine_to_worker_decoder, make_encoder
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, NewRequestData, SchedulerOutput

NUM_DECODE_REQS = 256
NUM_PREFILL_REQS = 8
PREFILL_LEN = 2048
TARGETS = {
    "ratio_tp1_max": 1.5,
    "ratio_tp2_max": 3.0,
    "ratio_ring_tp2_max": 1.5,
    "ratio_ring_tp2_to_ring_floor_max": 2.0,
    "decode_encode_decode_us_max": 25.0,
}


def decode_step(step_id: int) -> SchedulerOutput:
    """256 running requests, one new token each; every 16th gains a block (it crossed one)."""
    handles = range(1, NUM_DECODE_REQS + 1)
    num_computed = [100 + 7 * i for i in range(NUM_DECODE_REQS)]
    new_blocks = [([1000 + i],) if i % BLOCK_SIZE == 0 else None for i in range(NUM_DECODE_REQS)]
    cached = CachedRequestData(
        handles=pack_int32(handles),
        new_token_ids=pack_int32(i % 500 for i in handles),
        num_new_token_ids=pack_int32([1] * NUM_DECODE_REQS),
        new_block_ids=new_blocks,
        num_computed_tokens=pack_int32(num_computed),
    )
    return SchedulerOutput(
        step_id, [], cached, pack_int32([1] * NUM_DECODE_REQS), NUM_DECODE_REQS, [], []
    )


def prefill_step(step_id: int) -> SchedulerOutput:
    """8 new requests of 2,048 prompt tokens each, all scheduled in one step."""
    num_blocks = PREFILL_LEN // BLOCK_SIZE
    new_reqs = [
        NewRequestData(
            handle=i + 1,
            prompt_token_ids=pack_int32((i * 31 + t) % 500 for t in range(PREFILL_LEN)),
            sampling_params=SamplingParams(max_tokens=16),
            block_ids=(list(range(1 + i * num_blocks, 1 + (i + 1) * num_blocks)),),
            num_computed_tokens=0,
        )
        for i in range(NUM_PREFILL_REQS)
    ]
    num_scheduled = pack_int32([PREFILL_LEN] * NUM_PREFILL_REQS)
    return SchedulerOutput(
        step_id,
        new_reqs,
        CachedRequestData(),
        num_scheduled,
        PREFILL_LEN * NUM_PREFILL_REQS,
        [],
        [],
    )


def median_us(samples_s: list[float]) -> float:
    return statistics.median(samples_s) * 1e6


class RankGroup:
    """`tp_size` rank processes behind the engine's real WorkerGroup, ready for steps: the
    handshake and Shutdown use ZMQ, and steps go as the engine sends them, with its ring off
    (`is_ring` False: ZMQ both ways) or on (the ring out, each rank's reply lane back)."""

    def __init__(self, ctx: zmq.Context, address: str, tp_size: int, is_ring: bool) -> None:
        self.group = WorkerGroup(
            ctx, address, tp_size, STEP_TIMEOUT_S, 1.0, 10.0, is_shm_ring_enabled=is_ring
        )
        spawn = multiprocessing.get_context("spawn")
        self.procs = [
            spawn.Process(target=rank_main, args=(address, rank, tp_size))
            for rank in range(tp_size)
        ]
        for proc in self.procs:
            proc.start()
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        self.group.wait_for_hellos(deadline)
        self.group.send_kv_cache_config(KVCacheConfig(1 << 16, GROUPS))
        self.group.wait_for_ready(1 << 16, deadline)
        if is_ring and self.group.transport.zmq_ranks:
            raise RuntimeError(f"ranks {self.group.transport.zmq_ranks} did not take the ring")

    def sample(self, make_step: Callable[[int], SchedulerOutput], num_iters: int) -> list[float]:
        """Broadcast + gather times of `num_iters` steps, built ahead (not part of the trip)."""
        first_id = self.group.last_step_id + 1
        steps = [make_step(first_id + i) for i in range(num_iters)]
        samples = []
        for step in steps:
            start = time.perf_counter()
            self.group.execute_model(step)
            samples.append(time.perf_counter() - start)
        return samples

    def close(self) -> None:
        self.group.shutdown("benchmark done")
        for proc in self.procs:
            proc.join(STEP_TIMEOUT_S)
        self.group.close()


def measure_codec(make_step: Callable[[int], SchedulerOutput], num_iters: int) -> float:
    """Median in-process encode (engine) + decode (rank) of one step, in µs."""
    encoder, decoder = make_encoder(), engine_to_worker_decoder()
    step = make_step(1)
    samples = []
    for _ in range(num_iters):
        start = time.perf_counter()
        decoder.decode(encoder.encode(step))
        samples.append(time.perf_counter() - start)
    return median_us(samples)


STEP_KINDS = {"decode_256": decode_step, "prefill_8x2048": prefill_step}
FLOORS = {  # sample key -> (over the ring, reader spin_s or None for its default, echoes)
    "pingpong": (False, None, 1),
    "ring_pingpong": (True, None, 1),
    "ring_pingpong_asleep": (True, 0.0, 1),
    "ring_pingpong_tp2": (True, None, 2),
}
SHM_FLOORS = {"shm_pingpong_tp1": 1, "shm_pingpong_tp2": 2}  # sample key -> echoes
TRANSPORTS = {"": False, "ring_": True}  # step key prefix -> whether the engine's ring is on
Rounds = list[dict[str, list[float]]]  # per round, per figure: round-trip times in seconds


def run(num_iters: int, num_rounds: int) -> dict[str, float | int | str]:
    """Alternate short batches of every figure over `num_rounds`, so that load from other
    processes falls on the floors and on the steps alike."""
    ctx = zmq.Context()
    rounds: Rounds = []
    batch = max(1, num_iters // num_rounds)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as folder:
        floors, groups = {}, {}
        try:
            for key, (is_ring, spin_s, num_echoes) in FLOORS.items():
                address = f"ipc://{folder}/{key}"
                floors[key] = PingPong(ctx, address, is_ring, spin_s, num_echoes)
            for key, num_echoes in SHM_FLOORS.items():
                floors[key] = ShmPingPong(num_echoes)
            for prefix, is_ring in TRANSPORTS.items():
                for tp_size in (1, 2):
                    address = f"ipc://{folder}/{prefix}workers-{tp_size}"
                    groups[prefix, tp_size] = RankGroup(ctx, address, tp_size, is_ring)
            for _ in range(num_rounds):
                samples = {key: floor.sample(batch) for key, floor in floors.items()}
                for name, make_step in STEP_KINDS.items():
                    num_steps = batch if name == "decode_256" else max(1, batch // 4)
                    for (prefix, tp_size), group in groups.items():
                        samples[f"{prefix}{name}_tp{tp_size}"] = group.sample(make_step, num_steps)
                rounds.append(samples)
        finally:
            for closable in [*floors.values(), *groups.values()]:
                closable.close()
    ctx.term()
    return figures_from(rounds, num_iters)


def median_ratio(rounds: Rounds, key: str, floor_key: str) -> float:
    """The median over rounds of each round's median of `key` over its median of `floor_key`."""
    return statistics.median(
        statistics.median(samples[key]) / statistics.median(samples[floor_key])
        for samples in rounds
    )


def figures_from(rounds: Rounds, num_iters: int) -> dict[str, float | int | str]:
    """Medians over every sample of a figure; ratios are medians of per-round ratios."""
    pooled = {key: [s for samples in rounds for s in samples[key]] for key in rounds[0]}
    figures: dict[str, float | int | str] = {
        "pingpong_1byte_us": median_us(pooled["pingpong"]),
        "ring_pingpong_1byte_us": median_us(pooled["ring_pingpong"]),
        "ring_pingpong_1byte_reader_asleep_us": median_us(pooled["ring_pingpong_asleep"]),
        "ring_pingpong_1byte_tp2_us": median_us(pooled["ring_pingpong_tp2"]),
        "shm_roundtrip_1byte_tp1_us": median_us(pooled["shm_pingpong_tp1"]),
        "shm_roundtrip_1byte_tp2_us": median_us(pooled["shm_pingpong_tp2"]),
        "ratio_ring_pingpong_to_floor": median_ratio(rounds, "ring_pingpong", "pingpong"),
    }
    for name, make_step in STEP_KINDS.items():
        codec_iters = num_iters if name == "decode_256" else max(10, num_iters // 10)
        figures[f"{name}_encode_decode_us"] = measure_codec(make_step, codec_iters)
        figures[f"{name}_frame_bytes"] = len(make_encoder().encode(make_step(1)))
        for tp_size in (1, 2):
            key = f"{name}_tp{tp_size}"
            figures[f"{key}_us_per_step"] = median_us(pooled[key])
            figures[f"ratio_{key}_to_floor"] = median_ratio(rounds, key, "pingpong")
        for tp_size in (1, 2):  # the ring's own floor: a 1-byte round trip over it to as many ranks
            key, ring_floor = f"ring_{name}_tp{tp_size}", f"shm_pingpong_tp{tp_size}"
            figures[f"{key}_us_per_step"] = median_us(pooled[key])
            figures[f"ratio_{key}_to_floor"] = median_ratio(rounds, key, "pingpong")
            figures[f"ratio_{key}_to_ring_floor"] = median_ratio(rounds, key, ring_floor)
    return figures


def verdicts(figures: dict[str, float | int | str]) -> dict[str, str]:
    """Each target of DESIGN.md §1 and §5 against the measured figure."""
    codec_us = figures["decode_256_encode_decode_us"]
    codec_max_us = TARGETS["decode_encode_decode_us_max"]
    checks = {
        "target_decode_tp1": ("ratio_decode_256_tp1_to_floor", "ratio_tp1_max", "floor"),
        "target_decode_tp2": ("ratio_decode_256_tp2_to_floor", "ratio_tp2_max", "floor"),
        "target_ring_decode_tp2": (
            "ratio_ring_decode_256_tp2_to_floor",
            "ratio_ring_tp2_max",
            "floor",
        ),
        "target_ring_decode_tp2_own_floor": (
            "ratio_ring_decode_256_tp2_to_ring_floor",
            "ratio_ring_tp2_to_ring_floor_max",
            "ring floor",
        ),
    }
    found = {
        name: f"{figures[key]:.2f}x {floor} (target <= {TARGETS[target]}x)"
        for name, (key, target, floor) in checks.items()
    }
    found["target_decode_codec"] = f"{codec_us:.1f} us (target <= {codec_max_us} us)"
    return found


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="decode round trips per figure")
    args = parser.parse_args()
    figures = run(args.iters, num_rounds=max(1, args.repeats) * 4)
    figures.update(verdicts(figures))
    report("engine-worker transport (µs are medians per step)", figures, args.json)


if __name__ == "__main__":
    main()
