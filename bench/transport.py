"""Per-step round trip of the engine-worker transport against the raw ZeroMQ floor.

Measures a 1-byte ROUTER/DEALER ping-pong over ipc (the floor), then the engine's real broadcast
and gather (`WorkerGroup.execute_model`) of encoded SchedulerOutputs to 1 and 2 rank processes that
decode each step and reply, for a 256-request decode step and an 8 x 2,048-token prefill step. Also
the in-process encode + decode time of each step. Run: python -m bench.transport [--json FILE]
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
from protocol.buffers import pack_int32, unpack_int32
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
TARGETS = {"ratio_tp1_max": 1.5, "ratio_tp2_max": 3.0, "decode_encode_decode_us_max": 25.0}


def decode_step(step_id: int) -> SchedulerOutput:
    """256 running requests, one new token each; every 16th gains a block (it crossed one)."""
    handles = range(1, NUM_DECODE_REQS + 1)
    num_computed = [100 + 7 * i for i in range(NUM_DECODE_REQS)]
    new_blocks = [([1000 + i],) if i % BLOCK_SIZE == 0 else None for i in range(NUM_DECODE_REQS)]
    cached = CachedRequestData(
        req_ids=pack_int32(handles),
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
            req_id=i + 1,
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
    """What a rank sends back: one token per scheduled request, in SchedulerOutput order."""
    handles = [req.req_id for req in step.scheduled_new_reqs]
    handles.extend(unpack_int32(step.scheduled_cached_reqs.req_ids))
    return ModelRunnerOutput(
        step.step_id, rank, pack_int32(handles), pack_int32([7] * len(handles))
    )


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


def measure_floor(ctx: zmq.Context, folder: str, num_iters: int) -> float:
    """Median 1-byte ROUTER/DEALER round trip to another process over ipc, in µs."""
    address = f"ipc://{folder}/pingpong"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    proc = multiprocessing.get_context("spawn").Process(target=pong_main, args=(address,))
    proc.start()
    identity, _ = recv_within(router, HANDSHAKE_TIMEOUT_S, "hello from the pong process")
    samples = []
    for _ in range(num_iters):
        start = time.perf_counter()
        router.send_multipart((identity, b"x"))
        recv_within(router, STEP_TIMEOUT_S, "pong")
        samples.append(time.perf_counter() - start)
    router.send_multipart((identity, b"q"))
    proc.join(STEP_TIMEOUT_S)
    router.close(linger=0)
    return median_us(samples)


def measure_steps(
    ctx: zmq.Context,
    folder: str,
    tp_size: int,
    make_step: Callable[[int], SchedulerOutput],
    num_iters: int,
) -> float:
    """Median broadcast + gather of one step through WorkerGroup to `tp_size` rank processes."""
    address = f"ipc://{folder}/workers-{tp_size}-{make_step.__name__}"
    group = WorkerGroup(ctx, address, tp_size, STEP_TIMEOUT_S, 1.0, 10.0)
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=rank_main, args=(address, r, tp_size)) for r in range(tp_size)]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        group.wait_for_hellos(deadline)
        group.send_kv_cache_config(KVCacheConfig(1 << 16, GROUPS))
        group.wait_for_ready(1 << 16, deadline)
        steps = [make_step(i + 1) for i in range(num_iters)]  # built ahead: not part of the trip
        samples = []
        for step in steps:
            start = time.perf_counter()
            group.execute_model(step)
            samples.append(time.perf_counter() - start)
    finally:
        group.shutdown("benchmark done")
        for proc in procs:
            proc.join(STEP_TIMEOUT_S)
        group.close()
    return median_us(samples)


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


def run(num_iters: int) -> dict[str, float | int | str]:
    figures: dict[str, float | int | str] = {}
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as folder:
        floor_us = measure_floor(ctx, folder, num_iters)
        figures["pingpong_1byte_us"] = floor_us
        for name, make_step in (("decode_256", decode_step), ("prefill_8x2048", prefill_step)):
            codec_iters = num_iters if name == "decode_256" else max(10, num_iters // 10)
            figures[f"{name}_encode_decode_us"] = measure_codec(make_step, codec_iters)
            figures[f"{name}_frame_bytes"] = len(make_encoder().encode(make_step(1)))
            for tp_size in (1, 2):
                iters = num_iters if name == "decode_256" else max(20, num_iters // 10)
                step_us = measure_steps(ctx, folder, tp_size, make_step, iters)
                figures[f"{name}_tp{tp_size}_us_per_step"] = step_us
                figures[f"ratio_{name}_tp{tp_size}_to_floor"] = step_us / floor_us
    ctx.term()
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
    parser.add_argument("--iters", type=int, default=2000, help="round trips per figure (median)")
    args = parser.parse_args()
    figures = run(args.iters)
    figures.update(verdicts(figures))
    report("engine-worker transport (µs are medians per step)", figures, args.json)


if __name__ == "__main__":
    main()
