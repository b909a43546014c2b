"""Outputs and client lifetimes against a real engine: a slow reader, a client that vanishes, two
clients with the same request ids, and an abort sent just before close. Each checks that a
concurrent well-behaved client still gets exactly its reference tokens.
"""

import time

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.codec import make_encoder
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, wait_for
from tests.integration.hostile import (
    GOOD_PARAMS,
    MODEL,
    assert_served_exactly,
    good_client_alongside,
    raw_dealer,
    rss_bytes,
    serve,
    stop,
)
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

LONG = SamplingParams(max_tokens=450, ignore_eos=True)
# One output frame per step for all of a client's requests: thousands of steps fill the ZMQ
# queues (a high-water mark of 1,000 frames each side) and then the engine's backlog.
SLOW = SamplingParams(max_tokens=8000, ignore_eos=True)
LONGER_MODEL_LEN = ("--max-model-len", "8192")
# Small beside the queues: the bound acts a few hundred steps after they fill, not thousands
MAX_BACKLOG_BYTES = "20000"


def _stats(address: str) -> dict:
    with EngineClient(address, 30.0) as client:
        stats = client.get_stats()
    assert isinstance(stats, dict)
    return stats


def _idle(address: str) -> bool:
    stats = _stats(address)
    return stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0


@pytest.mark.timeout(300)  # a loaded 2-core machine fills the backlog slowly
def test_a_slow_reader_gets_its_outputs_in_order_or_a_reason_never_a_silent_gap(
    processes: Processes, addresses: dict
) -> None:
    """Defect 5: past the high-water mark outputs (final ones too) vanished without a log, and
    the stock client with ZMQ heartbeats died on a libzmq assertion under backpressure."""
    pid = serve(
        processes, addresses, "--max-client-backlog-bytes", MAX_BACKLOG_BYTES, *LONGER_MODEL_LEN
    )
    before = rss_bytes(pid)
    prompts = {f"slow-{i}": [5 + i, 9, 13] for i in range(8)}
    with EngineClient(addresses["client"], 60.0) as slow:
        for req_id, prompt in prompts.items():
            slow.add_request(make_request(req_id, prompt, SLOW))
        # The stats come over another connection, which may overtake the requests: see them held
        # first, or "idle" would be read before they arrive. They cannot end that soon, since
        # filling the backlog takes thousands of steps.
        wait_for(lambda: not _idle(addresses["client"]), 30, "the slow requests to be queued")
        with good_client_alongside(addresses["client"], "beside-slow"):
            # It reads nothing while thousands of output frames fill the ZMQ queues, the
            # socket buffers and then the engine's backlog, until the bound ends its requests.
            wait_for(lambda: _idle(addresses["client"]), 200, "the stalled requests to end")
        assert rss_bytes(pid) < before + 64 * 1024 * 1024
        results = slow.run_until_finished(list(prompts), 60)
    # The reference model is quadratic in Python: an undisturbed run of the same requests on
    # the same engine, cut to what the slow reader got, is the exact and fast comparison.
    undisturbed = {}
    with EngineClient(addresses["client"], 60.0) as reader:
        for req_id, prompt in prompts.items():
            num_tokens = max(1, len(results[req_id].token_ids))
            params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
            undisturbed[req_id] = reader.add_request(make_request(req_id, prompt, params))
        reader.run_until_finished(list(prompts), 120)
    for req_id, result in results.items():
        assert result.token_ids == undisturbed[req_id].token_ids[: len(result.token_ids)], req_id
        if result.error is None:
            assert len(result.token_ids) == SLOW.max_tokens and result.finish_reason == "length"
        else:
            assert result.finish_reason == "abort", result
            assert f"max_client_backlog_bytes={MAX_BACKLOG_BYTES}" in result.error, result.error
    assert any(result.error for result in results.values()), "the backlog bound never acted"
    wait_for(lambda: _idle(addresses["client"]), 30, "the slow reader's requests to be freed")
    assert_served_exactly(addresses["client"], "after-slow")
    stop(processes)


@pytest.mark.timeout(120)
def test_a_vanished_clients_requests_are_aborted_and_their_blocks_freed(
    processes: Processes, addresses: dict
) -> None:
    """Defect 6: 500 requests of a client that disappeared ran to completion."""
    serve(processes, addresses, "--max-num-seqs", "8")
    ctx = zmq.Context()
    gone = raw_dealer(ctx, addresses["client"])
    encoder = make_encoder()
    for idx in range(300):
        gone.send(encoder.encode(make_request(f"gone-{idx}", [idx % 40 + 1] * 16, LONG)))
    wait_for(lambda: _stats(addresses["client"])["num_running_reqs"] > 0, 30, "the flood to run")
    gone.close(linger=0)
    start = time.monotonic()
    wait_for(lambda: _idle(addresses["client"]), 20, "the vanished client's requests to go")
    assert time.monotonic() - start < 10
    stats = _stats(addresses["client"])
    assert stats["kv_cache_usage"] == 0.0, stats
    assert stats["num_output_tokens"] < 300 * LONG.max_tokens // 10, stats
    assert "requests of a client that left" in processes.log("core")
    assert_served_exactly(addresses["client"], "after-vanish")
    ctx.destroy(linger=0)
    stop(processes)


@pytest.mark.timeout(120)
def test_request_ids_are_scoped_by_client(processes: Processes, addresses: dict) -> None:
    """Defect 7: a second client could abort the first's request by naming its id, and two
    clients using the same ids failed with "duplicate req_id"."""
    serve(processes, addresses)
    with (
        EngineClient(addresses["client"], 60.0) as first,
        EngineClient(addresses["client"], 60.0) as second,
    ):
        kept = first.add_request(make_request("shared", [4, 4, 4], LONG))
        wait_for(lambda: first.poll_outputs(0.1) or kept.token_ids, 30, "first tokens")
        mine = second.add_request(make_request("shared", [6, 6, 6], GOOD_PARAMS))
        second.abort(["shared"])  # its own "shared", not the first client's
        second.run_until_finished(["shared"], 30)
        first.run_until_finished(["shared"], 60)
    assert kept.error is None and kept.token_ids == reference_generate(MODEL, [4, 4, 4], LONG)
    assert mine.finish_reason in ("abort", "length"), mine
    expected = reference_generate(MODEL, [6, 6, 6], GOOD_PARAMS)
    assert mine.token_ids == expected[: len(mine.token_ids)]
    stop(processes)


@pytest.mark.timeout(120)
def test_an_abort_sent_just_before_close_is_delivered(
    processes: Processes, addresses: dict
) -> None:
    """Defect 8: with LINGER 0 an abort followed by close() was lost; the request ran on."""
    serve(processes, addresses)
    client = EngineClient(addresses["client"], 60.0)
    result = client.add_request(make_request("doomed", [8, 8, 9], LONG))
    wait_for(lambda: client.poll_outputs(0.1) or result.token_ids, 30, "first tokens")
    client.abort(["doomed"])
    client.close()
    wait_for(lambda: _idle(addresses["client"]), 10, "the aborted request to stop")
    assert _stats(addresses["client"])["num_output_tokens"] < LONG.max_tokens
    # The abort ended it, not the engine noticing the closed client afterwards.
    assert "requests of a client that left" not in processes.log("core")
    assert_served_exactly(addresses["client"], "after-close")
    stop(processes)
