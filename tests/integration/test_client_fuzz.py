"""Fuzz of the engine's client socket: 10,000 random and mutated frames (valid messages with fields
flipped, truncated, nested, oversized) while requests are served. The engine never exits, every
valid request finishes with exactly its reference tokens, and its memory stays within 10 %.
"""

import random

import msgspec
import pytest
import zmq

from engine_client.request import make_request
from protocol.client_messages import AbortRequests, UtilityCall, UtilityResult
from protocol.codec import engine_to_client_decoder, make_encoder
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes
from tests.integration.hostile import (
    MAX_MODEL_LEN,
    assert_served_exactly,
    good_client_alongside,
    raw_dealer,
    rss_bytes,
    serve,
    stop,
)

pytestmark = pytest.mark.integration

NUM_FRAMES = 10_000
OVERSIZED_BYTES = 4 * MAX_MODEL_LEN + 128 * 1024  # past the engine's frame limit
BARRIER_EVERY = 100  # frames between two barriers
BARRIER_CALL_ID = 1 << 40  # far from the call ids the mutations produce
BARRIER_TIMEOUT_MS = 30_000


def _valid_messages() -> list[dict]:
    """Valid client messages as plain maps, the material the mutations start from."""
    request = make_request("fuzz", [1, 2, 3, 4], SamplingParams(max_tokens=2))
    fields = msgspec.to_builtins(request, builtin_types=(bytes,))
    fields["type"] = "EngineCoreRequest"
    abort = {"type": "AbortRequests", **msgspec.to_builtins(AbortRequests(["fuzz", "x"]))}
    call = {"type": "UtilityCall", **msgspec.to_builtins(UtilityCall(1, "get_stats"))}
    return [fields, abort, call]


HOSTILE_VALUES = [
    None, -1, 0, 2**64 - 1, -(2**63), 1.5, float("inf"), "", "x" * 5000, b"\x00" * 7,
    [], [[[]]], {}, {"a": {"b": [1]}}, True, "EngineCoreRequest",
]  # fmt: skip


def _mutate(rng: random.Random, message: dict, index: int) -> bytes:
    kind = rng.randrange(6)
    fields = dict(message)
    if kind == 0:  # a field flipped to a hostile value
        fields[rng.choice(list(fields))] = rng.choice(HOSTILE_VALUES)
    elif kind == 1:  # an unknown field, or a field removed
        fields.pop(rng.choice(list(fields)))
        fields[f"extra{index}"] = rng.choice(HOSTILE_VALUES)
    elif kind == 2:  # nested deep
        fields[rng.choice(list(fields))] = msgspec.Raw(b"\x91" * 3000 + b"\x00")
    if "req_id" in fields and rng.random() < 0.5:
        fields["req_id"] = f"fuzz-{index}"  # a distinct id, so that valid requests can run
    frame = msgspec.msgpack.encode(fields)
    if kind == 3:  # truncated
        return frame[: rng.randrange(len(frame))]
    if kind == 4:  # random bytes
        return rng.randbytes(rng.randrange(1, 64))
    return frame


def _fuzz(ctx: zmq.Context, address: str, rng: random.Random, num_frames: int) -> None:
    """Send `num_frames` hostile frames. Every BARRIER_EVERY frames a health check follows, and
    its answer (frames of one connection are handled in order) shows the engine has read all
    before it, so the engine's queues stay short and its memory measures what it keeps."""
    messages, decoder, encoder = _valid_messages(), engine_to_client_decoder(), make_encoder()
    fuzzer = raw_dealer(ctx, address)
    for index in range(num_frames):
        if index % 1000 == 999:  # oversized: the engine drops the connection, we reconnect
            fuzzer.send(b"\x00" * OVERSIZED_BYTES)
            fuzzer.close(linger=1000)
            fuzzer = raw_dealer(ctx, address)
            continue
        fuzzer.send(_mutate(rng, rng.choice(messages), index))
        if index % BARRIER_EVERY == 0:
            fuzzer.send(encoder.encode(UtilityCall(BARRIER_CALL_ID + index, "check_health")))
            _read_until_answered(fuzzer, decoder, BARRIER_CALL_ID + index)
    fuzzer.close(linger=0)


def _read_until_answered(sock: zmq.Socket, decoder: object, call_id: int) -> None:
    while True:
        assert sock.poll(BARRIER_TIMEOUT_MS), f"no answer to barrier {call_id}"
        message = decoder.decode(sock.recv())  # type: ignore[attr-defined]
        if isinstance(message, UtilityResult) and message.call_id == call_id:
            return


@pytest.mark.timeout(300)
def test_ten_thousand_hostile_frames_leave_the_engine_serving_exactly(
    processes: Processes, addresses: dict
) -> None:
    pid = serve(processes, addresses)
    rng, ctx = random.Random(7), zmq.Context()
    assert_served_exactly(addresses["client"], "warm-up", 8)
    _fuzz(ctx, addresses["client"], rng, 2000)  # every path has run once: the allocator is warm
    before = rss_bytes(pid)
    with good_client_alongside(addresses["client"], "fuzzed"):
        _fuzz(ctx, addresses["client"], rng, NUM_FRAMES)
    assert processes.procs["core"].poll() is None, processes.log("core")[-3000:]
    assert_served_exactly(addresses["client"], "after-fuzz", 8)
    after = rss_bytes(pid)
    assert after <= before * 1.10, f"engine memory grew from {before} to {after} bytes"
    ctx.destroy(linger=0)
    stop(processes)
