"""Per-step round trip of the engine-worker transport against the raw ZeroMQ floor.

A 1-byte ROUTER/DEALER ping-pong over ipc (the floor), interleaved with the engine's real broadcast
and gather (`WorkerGroup.execute_model`) of a 256-request decode step and an 8 x 2,048-token prefill
to 1 and 2 rank processes, plus each step's encode + decode time. python -m bench.transport
"""

import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable

import zmq

from bench.report import base_parser, report
from engine_core.worker_group import WorkerGroup
from protocol import PROTOCOL_VERSION
from protocol.buffers import pack_int32
from protocol.codec import engine_to_worker_decoder, make_encoder
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from protocol.sampling import SamplingParams
from protocol.worker_messages import (
    CachedRequestData,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    Shutdown,
    WorkerHello,
    WorkerReady,
)

BLOCK_SIZE = 16
NUM_DECODE_REQS = 256
NUM_PREFILL_REQS = 8
PREFILL_LEN = 2048
HANDSHAKE_TIMEOUT_S = 60.0
STEP_TIMEOUT_S = 10.0
RANK_IDLE_TIMEOUT_MS = 60_000
GROUPS = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(BLOCK_SIZE, 2, 8, "float32"))]
MODEL_INFO = ModelInfo("transport-bench", 512, None, 4096, GROUPS)
SAMPLED_TOKEN = pack_int32([7])
TARGETS = {"ratio_tp1_max": 1.5, "ratio_tp2_max": 3.0, "decode_encode_decode_us_max": 25.0}


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


def reply_for(step: SchedulerOutput, rank: int) -> ModelRunnerOutput:
    """What a rank sends back: one token per scheduled request, in SchedulerOutput order.

    Built the way a worker holds it: the handles as the int32 bytes they arrived in, the sampled
    tokens as one int32 buffer.
    """
    new_handles = pack_int32(req.handle for req in step.scheduled_new_reqs)
    handles = new_handles + step.scheduled_cached_reqs.handles
    sampled = SAMPLED_TOKEN * (len(handles) // 4)
    return ModelRunnerOutput(step.step_id, rank, handles, sampled)


def rank_main(address: str, rank: int, tp_size: int) -> None:
    """A rank that decodes every step in full and replies; no model runs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    encoder, decoder = make_encoder(), engine_to_worker_decoder()
    hello = WorkerHello(
        PROTOCOL_VERSION,
        rank,
        tp_size,
        os.getpid(),
        socket.gethostname(),
        "cpu",
        MODEL_INFO,
        1 << 20,
    )
    sock.send(encoder.encode(hello))
    while sock.poll(RANK_IDLE_TIMEOUT_MS):
        match decoder.decode(sock.recv()):
            case KVCacheConfig() as config:
                sock.send(encoder.encode(WorkerReady(rank, config.num_blocks)))
            case SchedulerOutput() as step:
                sock.send(encoder.encode(reply_for(step, rank)))
            case Shutdown():
                break
    sock.close(linger=0)
    ctx.term()


def pong_main(address: str) -> None:
    """Says hello once so the ROUTER learns its identity, then echoes every frame until "q"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(b"h")
    while sock.poll(RANK_IDLE_TIMEOUT_MS):
        frame = sock.recv()
        if frame == b"q":
            break
        sock.send(frame)
    sock.close(linger=0)
    ctx.term()


def median_us(samples_s: list[float]) -> float:
    return statistics.median(samples_s) * 1e6


def recv_within(sock: zmq.Socket, timeout_s: float, what: str) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no {what} in {timeout_s} s")
    return sock.recv_multipart()


class PingPong:
    """A 1-byte ROUTER/DEALER round trip to another process over ipc: the ZMQ floor."""

    def __init__(self, ctx: zmq.Context, folder: str) -> None:
        address = f"ipc://{folder}/pingpong"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(address)
        self.proc = multiprocessing.get_context("spawn").Process(target=pong_main, args=(address,))
        self.proc.start()
        self.identity, _ = recv_within(self.router, HANDSHAKE_TIMEOUT_S, "hello from pong")

    def sample(self, num_iters: int) -> list[float]:
        samples = []
        for _ in range(num_iters):
            start = time.perf_counter()
            self.router.send_multipart((self.identity, b"x"))
            recv_within(self.router, STEP_TIMEOUT_S, "pong")
            samples.append(time.perf_counter() - start)
        return samples

    def close(self) -> None:
        self.router.send_multipart((self.identity, b"q"))
        self.proc.join(STEP_TIMEOUT_S)
        self.router.close(linger=0)


class RankGroup:
    """`tp_size` rank processes behind the engine's real WorkerGroup, ready for steps."""

    def __init__(self, ctx: zmq.Context, folder: str, tp_size: int) -> None:
        address = f"ipc://{folder}/workers-{tp_size}"
        self.group = WorkerGroup(ctx, address, tp_size, STEP_TIMEOUT_S, 1.0, 10.0)
        spawn = multiprocessing.get_context("spawn")
        self.procs = [
            spawn.Process(target=rank_main, args=(address, r, tp_size)) for r in range(tp_size)
        ]
        for proc in self.procs:
            proc.start()
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        self.group.wait_for_hellos(deadline)
        self.group.send_kv_cache_config(KVCacheConfig(1 << 16, GROUPS))
        self.group.wait_for_ready(1 << 16, deadline)

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


def run(num_iters: int, num_rounds: int) -> dict[str, float | int | str]:
    """Alternate short batches of every figure over `num_rounds`, so that load from other
    processes falls on the floor and on the steps alike; medians over all samples."""
    ctx = zmq.Context()
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as folder:
        floor = PingPong(ctx, folder)
        groups = {tp_size: RankGroup(ctx, folder, tp_size) for tp_size in (1, 2)}
        try:
            for _ in range(num_rounds):
                batch = max(1, num_iters // num_rounds)
                samples.setdefault("pingpong", []).extend(floor.sample(batch))
                for name, make_step in STEP_KINDS.items():
                    steps = batch if name == "decode_256" else max(1, batch // 4)
                    for tp_size, group in groups.items():
                        key = f"{name}_tp{tp_size}"
                        samples.setdefault(key, []).extend(group.sample(make_step, steps))
        finally:
            floor.close()
            for group in groups.values():
                group.close()
    ctx.term()
    return figures_from(samples, num_iters)


def figures_from(samples: dict[str, list[float]], num_iters: int) -> dict[str, float | int | str]:
    floor_us = median_us(samples["pingpong"])
    figures: dict[str, float | int | str] = {"pingpong_1byte_us": floor_us}
    for name, make_step in STEP_KINDS.items():
        codec_iters = num_iters if name == "decode_256" else max(10, num_iters // 10)
        figures[f"{name}_encode_decode_us"] = measure_codec(make_step, codec_iters)
        figures[f"{name}_frame_bytes"] = len(make_encoder().encode(make_step(1)))
        for tp_size in (1, 2):
            step_us = median_us(samples[f"{name}_tp{tp_size}"])
            figures[f"{name}_tp{tp_size}_us_per_step"] = step_us
            figures[f"ratio_{name}_tp{tp_size}_to_floor"] = step_us / floor_us
    return figures


def verdicts(figures: dict[str, float | int | str]) -> dict[str, str]:
    """Each target of DESIGN.md §1 and §5 against the measured figure."""
    ratio_1, ratio_2 = (
        figures["ratio_decode_256_tp1_to_floor"],
        figures["ratio_decode_256_tp2_to_floor"],
    )
    codec_us = figures["decode_256_encode_decode_us"]
    codec_max_us = TARGETS["decode_encode_decode_us_max"]
    return {
        "target_decode_tp1": f"{ratio_1:.2f}x floor (target <= {TARGETS['ratio_tp1_max']}x)",
        "target_decode_tp2": f"{ratio_2:.2f}x floor (target <= {TARGETS['ratio_tp2_max']}x)",
        "target_decode_codec": f"{codec_us:.1f} us (target <= {codec_max_us} us)",
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="decode round trips per figure")
    args = parser.parse_args()
    figures = run(args.iters, num_rounds=max(1, args.repeats) * 4)
    figures.update(verdicts(figures))
    report("engine-worker transport (µs are medians per step)", figures, args.json)


if __name__ == "__main__":
    main()
