"""Hostile or careless clients against a real engine: each test reproduces one way a client used to
hurt the engine or other clients, and checks that a concurrent well-behaved client still gets
exactly its reference tokens.
"""

import threading
import time

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.client_messages import AbortRequests
from protocol.codec import make_encoder
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes
from tests.integration.hostile import (
    GOOD_PARAMS,
    MODEL,
    assert_served_exactly,
    good_client_alongside,
    raw_dealer,
    replies,
    rss_bytes,
    serve,
    stop,
)
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_deeply_nested_frames_are_rejected_and_the_engine_serves_on(
    processes: Processes, addresses: dict
) -> None:
    """Defect 1: 1,000 nested msgpack arrays (a 1 KB frame) killed the engine."""
    serve(processes, addresses)
    ctx = zmq.Context()
    hostile = raw_dealer(ctx, addresses["client"])
    with good_client_alongside(addresses["client"], "nested"):
        for frame in (b"\x91" * 1000 + b"\x00", b"\x81\x00" * 1000 + b"\x00"):
            for _ in range(50):
                hostile.send(frame)
        hostile.send(b"\x81\xa6req_id" + b"\x91" * 30_000 + b"\x00")  # under the size limit
        answers = replies(hostile, 2.0)
    errors = [output.error or "" for batch in answers for output in batch.outputs]
    assert len(errors) == 101 and all("malformed frame" in error for error in errors), errors[:3]
    ctx.destroy(linger=0)
    stop(processes)


@pytest.mark.timeout(120)
def test_oversized_frames_never_reach_the_engine_and_bounded_fields_are_refused(
    processes: Processes, addresses: dict
) -> None:
    """Defect 2: three 1 GB frames took the engine to 3.9 GB; a 1 MB cache_salt and a priority
    of 2**64-1 were accepted. A 1 MB salt now exceeds the frame limit (the connection is
    dropped before Python reads it); one just past the field's bound gets a reason."""
    pid = serve(processes, addresses)
    before = rss_bytes(pid)
    ctx = zmq.Context()
    with good_client_alongside(addresses["client"], "oversized"):
        for _ in range(3):  # each far past 4 * max_model_len plus headroom
            hostile = raw_dealer(ctx, addresses["client"])
            hostile.send(b"\x00" * (64 * 1024 * 1024))
        time.sleep(1.0)
    assert rss_bytes(pid) < before + 32 * 1024 * 1024, (before, rss_bytes(pid))
    with EngineClient(addresses["client"], 30.0) as client:
        salted = client.add_request(
            make_request("salty", [1, 2, 3], GOOD_PARAMS, cache_salt="s" * 5000)
        )
        urgent = client.add_request(make_request("urgent", [1, 2, 3], GOOD_PARAMS, 2**64 - 1))
        client.run_until_finished(["salty", "urgent"], 30)
    assert "cache_salt" in (salted.error or ""), salted.error
    assert "priority" in (urgent.error or ""), urgent.error
    ctx.destroy(linger=0)
    stop(processes)


@pytest.mark.timeout(120)
def test_a_client_flooding_aborts_does_not_stop_generation(
    processes: Processes, addresses: dict
) -> None:
    """Defect 3: tiny AbortRequests at about 47k/s stopped all generation for 10 s."""
    serve(processes, addresses, "--max-client-frames-per-step", "64")
    ctx = zmq.Context()
    flooding = threading.Event()
    flooding.set()

    def flood() -> None:
        sock = raw_dealer(ctx, addresses["client"], SNDHWM=100_000)
        frame = make_encoder().encode(AbortRequests(req_ids=["nothing-here"]))
        deadline = time.monotonic() + 60
        while flooding.is_set() and time.monotonic() < deadline:
            for _ in range(1000):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
        sock.close(linger=0)

    flooder = threading.Thread(target=flood, name="flood")
    flooder.start()
    try:
        time.sleep(0.5)
        start = time.monotonic()
        assert_served_exactly(addresses["client"], "under-flood")
        took_s = time.monotonic() - start
    finally:
        flooding.clear()
        flooder.join(30)
    assert took_s < 30, f"a 24-token request took {took_s:.1f} s under the flood"
    ctx.destroy(linger=0)
    stop(processes)


@pytest.mark.timeout(120)
def test_past_the_admission_limits_requests_are_refused_as_busy(
    processes: Processes, addresses: dict
) -> None:
    """Defect 4: 20,000 queued requests were all accepted."""
    serve(
        processes,
        addresses,
        "--max-num-waiting-requests",
        "40",
        "--max-num-requests-per-client",
        "30",
        "--max-num-seqs",
        "4",
    )
    long_params = SamplingParams(max_tokens=400, ignore_eos=True)
    with EngineClient(addresses["client"], 60.0) as greedy:
        for idx in range(60):
            greedy.add_request(make_request(f"g{idx}", [idx % 50 + 1] * 8, long_params))
        # The engine answers one client's messages in order: once this reply is here, all 60
        # were admitted or refused, and 26 wait. A fixed sleep raced a fast engine, which had
        # finished enough of them to leave room for every other request.
        assert greedy.get_stats()["num_waiting_reqs"] > 20  # so some of the next 20 are refused
        with EngineClient(addresses["client"], 60.0) as other:
            results = {
                f"o{idx}": other.add_request(make_request(f"o{idx}", [7, 7, 7], GOOD_PARAMS))
                for idx in range(20)
            }
            other.run_until_finished(list(results), 90)
        greedy.abort([f"g{idx}" for idx in range(60)])
        finished = greedy.run_until_finished([f"g{idx}" for idx in range(60)], 60)
    busy = [r.error for r in finished.values() if r.error and "client busy" in r.error]
    assert len(busy) == 30, f"{len(busy)} of 60 refused as client busy"
    assert "max_num_requests_per_client=30" in busy[0] and "retry" in busy[0]
    engine_busy = [r.error for r in results.values() if r.error and "engine busy" in r.error]
    served = [r for r in results.values() if r.error is None]
    assert engine_busy and served, (engine_busy, len(served))
    for result in served:
        assert result.token_ids == reference_generate(MODEL, [7, 7, 7], GOOD_PARAMS)
    assert_served_exactly(addresses["client"], "after-busy")
    stop(processes)
