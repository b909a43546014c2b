"""Requests belong to the client that sent them: ids are scoped by client, aborts touch only the
sender's own requests, and admission bounds the waiting queue and each client's share."""

import pytest
from fake_executor import Harness, MakeHarness, reference_tokens

from engine_core.sched.admission import scoped_req_id
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from protocol.sampling import SamplingParams

ALICE, BOB = b"\x00alice", b"\x00bob"


def _request(req_id: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, pack_int32(prompt), params, 0.0)


def _run(harness: Harness) -> dict[tuple[bytes, str], list[int | FinishReason | None]]:
    """Step to the end; each (client, req_id)'s tokens, then its finish reason."""
    seen: dict[tuple[bytes, str], list] = {}
    while harness.core.has_work():
        for client_id, outputs in harness.core.step().items():
            _absorb(seen, client_id, outputs)
    return seen


def _absorb(seen: dict, client_id: bytes, outputs: EngineCoreOutputs) -> None:
    for output in outputs.outputs:
        entry = seen.setdefault((client_id, output.req_id), [])
        entry.extend(output.new_token_ids)
        if output.finish_reason is not None:
            entry.append(output.finish_reason)


def test_two_clients_may_use_the_same_req_id(make_harness: MakeHarness) -> None:
    """Guards against one namespace for all clients: a second client's "r" was a duplicate."""
    harness = make_harness()
    assert harness.core.add_request(_request("r", [1, 2, 3]), ALICE) is None
    assert harness.core.add_request(_request("r", [4, 5, 6, 7]), BOB) is None
    seen = _run(harness)
    assert seen[ALICE, "r"] == [*reference_tokens([1, 2, 3], 4, 64), FinishReason.LENGTH]
    assert seen[BOB, "r"] == [*reference_tokens([4, 5, 6, 7], 4, 64), FinishReason.LENGTH]


def test_a_duplicate_is_refused_only_within_one_client(make_harness: MakeHarness) -> None:
    harness = make_harness()
    assert harness.core.add_request(_request("r", [1, 2]), ALICE) is None
    rejection = harness.core.add_request(_request("r", [1, 2]), ALICE)
    assert rejection is not None and "duplicate" in (rejection.outputs[0].error or "")
    _run(harness)


def test_an_abort_touches_only_the_senders_own_request(make_harness: MakeHarness) -> None:
    """Guards against a client aborting another client's request by naming its id."""
    harness = make_harness()
    harness.core.add_request(_request("r", [1, 2, 3], max_tokens=8), ALICE)
    harness.core.add_request(_request("r", [1, 2, 3], max_tokens=8), BOB)
    harness.core.step()
    outputs = harness.core.abort_requests(["r"], BOB)
    assert list(outputs) == [BOB]
    assert outputs[BOB].outputs[0].finish_reason is FinishReason.ABORT
    assert scoped_req_id(ALICE, "r") in harness.scheduler.requests
    assert scoped_req_id(BOB, "r") not in harness.scheduler.requests
    seen = _run(harness)
    assert seen[ALICE, "r"][-1] is FinishReason.LENGTH and len(seen[ALICE, "r"]) == 8


def test_a_client_that_left_has_all_its_requests_aborted_and_freed(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(num_blocks=48)
    for idx in range(5):
        harness.core.add_request(_request(f"r{idx}", [idx + 1] * 9, max_tokens=20), ALICE)
    harness.core.add_request(_request("keep", [7, 7, 7], max_tokens=5), BOB)
    harness.core.step()
    outputs = harness.core.abort_client(ALICE, "the client left")
    assert list(outputs) == [ALICE] and len(outputs[ALICE].outputs) == 5
    assert {output.error for output in outputs[ALICE].outputs} == {"the client left"}
    assert harness.core.client_ids() == [BOB]
    assert harness.core.abort_client(ALICE, "again") == {}
    seen = _run(harness)
    assert seen[BOB, "keep"][-1] is FinishReason.LENGTH


def test_past_max_num_waiting_requests_a_request_is_refused_as_busy(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(max_num_waiting_requests=3)
    for idx in range(3):
        assert harness.core.add_request(_request(f"r{idx}", [1, 2]), ALICE) is None
    rejection = harness.core.add_request(_request("r3", [1, 2]), BOB)
    assert rejection is not None
    (output,) = rejection.outputs
    assert output.req_id == "r3" and output.finish_reason is FinishReason.ERROR
    assert "engine busy" in (output.error or "") and "max_num_waiting_requests=3" in output.error
    _run(harness)
    assert harness.core.add_request(_request("r3", [1, 2]), BOB) is None  # room again
    _run(harness)


def test_past_max_num_requests_per_client_only_that_client_is_refused(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(max_num_requests_per_client=2)
    assert harness.core.add_request(_request("a", [1, 2]), ALICE) is None
    assert harness.core.add_request(_request("b", [1, 2]), ALICE) is None
    rejection = harness.core.add_request(_request("c", [1, 2]), ALICE)
    assert rejection is not None and "client busy" in (rejection.outputs[0].error or "")
    assert harness.core.add_request(_request("c", [1, 2]), BOB) is None
    _run(harness)
    harness.core.check_invariants()


@pytest.mark.parametrize("client_id", [b"", b"\x00\x01"])
def test_scoped_ids_keep_in_process_ids_and_never_collide_across_clients(
    client_id: bytes,
) -> None:
    assert scoped_req_id(b"", "r") == "r"
    assert scoped_req_id(client_id + b"x", "r") != scoped_req_id(client_id + b"y", "r")
