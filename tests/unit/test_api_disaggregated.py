"""The front end's two-phase flow (api_server/routing/disaggregated.py) over fake engine clients,
without sockets: which engines pair up (a layout that differs is refused, naming the field), the
request each engine gets, the release of the handle, what a failed prefill engine costs, and the
router's load back to zero after each request."""

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from api_server.routing import engine_handle, engine_pool
from api_server.routing.disaggregated import describe_layout_mismatch
from engine_client.errors import EngineDeadError
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from protocol.kv_transfer import KVTransferHandle, KVTransferLayout
from protocol.sampling import SamplingParams

LAYOUT = {"kv_layout_model": "m", "kv_layout_block_size": 16, "kv_layout_tp_size": 1}
HANDLE = KVTransferHandle(
    "engine", 7, "ab" * 16, [3, 4], 20, ["ipc:///x"], KVTransferLayout("m", 16, "float32", 1, 64)
)


class FakeClient:
    """An engine client that answers from a script and records what it was sent."""

    def __init__(self, address: str, timeout_s: float = 0.0, curve: object = None) -> None:
        self.address = address
        self.model_info = {"max_model_len": 128}
        self.sent: list[EngineCoreRequest] = []
        self.calls: list[tuple[str, tuple]] = []
        self.aborted: list[str] = []
        self.outputs: list[EngineCoreOutput] = []
        self.error: Exception | None = None

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        self.sent.append(request)
        if self.error is not None:
            raise self.error
        for output in self.outputs:
            yield msgspec.structs.replace(output, req_id=request.req_id)

    async def call_utility(self, method: str, *args: object) -> object:
        self.calls.append((method, args))
        return True

    async def abort(self, req_ids: list[str]) -> None:
        self.aborted += req_ids

    async def close(self) -> None:
        pass


def _pool(
    monkeypatch: pytest.MonkeyPatch, roles: list[str], layouts: list[dict] | None = None
) -> engine_pool.EnginePool:
    monkeypatch.setattr(engine_handle, "AsyncEngineClient", FakeClient)
    pool = engine_pool.EnginePool([f"ipc:///{role}" for role in roles], 16, 5.0)
    for idx, record in enumerate(pool.records):
        record.is_healthy = True
        record.routing_info = {"kv_role": roles[idx], **(layouts or [LAYOUT] * len(roles))[idx]}
        record.kv_role = roles[idx]
    pool._check_kv_layouts()
    return pool


def _client(pool: engine_pool.EnginePool, idx: int) -> FakeClient:
    client = pool.handles[idx].client
    assert isinstance(client, FakeClient)
    return client


def _request(max_tokens: int = 4) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(2, max_tokens), ignore_eos=True)
    return EngineCoreRequest("r1", pack_int32(list(range(3, 23))), params, 0.0)


async def _served(pool: engine_pool.EnginePool, request: EngineCoreRequest) -> list:
    outputs = [out async for out in pool.generate(request, list(range(3, 23)), 24)]
    await asyncio.sleep(0)  # the background release runs
    return outputs


def _assert_load_released(pool: engine_pool.EnginePool) -> None:
    pool.router.check_invariants()
    loads = [record.load for record in pool.records]
    assert sum(load.outstanding_tokens for load in loads) == 0
    assert sum(load.num_running for load in loads) == sum(load.num_waiting for load in loads) == 0


def test_the_pool_hands_one_record_per_engine_to_its_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One record per engine: the handles, the router and the first-block policy all hold the
    pool's records themselves, so a count written by one is the count every reader sees."""
    pool = _pool(monkeypatch, ["prefill", "decode"])
    assert [handle.record for handle in pool.handles] == pool.records
    assert pool.router.records is pool.records and pool.router.first_block.records is pool.records
    assert [record.engine_idx for record in pool.records] == [0, 1]
    assert [record.address for record in pool.records] == ["ipc:///prefill", "ipc:///decode"]


def test_a_decode_engine_whose_layout_differs_is_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = {**LAYOUT, "kv_layout_block_size": 32}
    pool = _pool(monkeypatch, ["prefill", "decode"], [LAYOUT, other])
    assert pool.records[1].kv_layout_mismatch == "block_size: 16 != 32"
    assert pool.pd_engines() is None
    assert describe_layout_mismatch(LAYOUT, LAYOUT) is None
    assert pool.router_stats()["engines"][1]["kv_layout_mismatch"] == "block_size: 16 != 32"


def test_a_decode_engine_of_a_larger_tp_size_pairs_when_no_head_is_replicated() -> None:
    """Decode TP 2 against prefill TP 1: each decode rank holds half of a prefill page."""
    prefill = msgspec.structs.asdict(KVTransferLayout("m", 16, "float32", 1, 64, 2, "f1"))
    decode = {**prefill, "tp_size": 2, "page_bytes": 32}
    assert describe_layout_mismatch(prefill, decode) is None
    replicated = {**decode, "page_bytes": 64}
    assert describe_layout_mismatch(prefill, replicated).startswith("page_bytes: 64 != 64 (")
    narrower = {**prefill, "tp_size": 3, "page_bytes": 64}
    assert describe_layout_mismatch(decode, narrower).startswith("tp_size: 2 != 3 (")
    other_model = {**decode, "model_fingerprint": "f2"}
    assert describe_layout_mismatch(prefill, other_model) == "model_fingerprint: 'f1' != 'f2'"


def test_a_request_goes_through_prefill_then_decode_and_its_handle_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _pool(monkeypatch, ["prefill", "decode"])
    prefill, decode = _client(pool, 0), _client(pool, 1)
    prefill.outputs = [EngineCoreOutput("", [9], FinishReason.LENGTH, 0, kv_transfer_handle=HANDLE)]
    decode.outputs = [
        EngineCoreOutput("", [5], None, 16),
        EngineCoreOutput("", [6, 7, 8], FinishReason.LENGTH, 16),
    ]
    outputs = asyncio.run(_served(pool, _request()))
    assert [token for out in outputs for token in out.new_token_ids] == [5, 6, 7, 8]
    (sent,) = prefill.sent
    assert sent.do_remote_decode and sent.sampling_params.max_tokens == 1
    assert sent.sampling_params.min_tokens == 1
    (sent,) = decode.sent
    assert sent.kv_transfer_handle == HANDLE and sent.sampling_params == _request().sampling_params
    assert prefill.calls == [("release_kv_transfer", (7, "ab" * 16))]
    assert pool.router_stats()["pd_requests"] == 1
    assert pool.router_stats()["engines"][0]["kv_role"] == "prefill"
    _assert_load_released(pool)


def test_a_failed_prefill_engine_costs_the_transfer_not_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _pool(monkeypatch, ["prefill", "decode"])
    prefill, decode = _client(pool, 0), _client(pool, 1)
    prefill.error = EngineDeadError("the prefill engine died")
    decode.outputs = [EngineCoreOutput("", [5, 6, 7, 8], FinishReason.LENGTH, 0)]
    outputs = asyncio.run(_served(pool, _request()))
    assert outputs[-1].new_token_ids == [5, 6, 7, 8]
    assert decode.sent[0].kv_transfer_handle is None and not prefill.calls
    assert pool.router_stats()["pd_recomputed_requests"] == 1
    _assert_load_released(pool)


def test_a_request_that_stops_at_its_first_token_ends_on_the_prefill_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _pool(monkeypatch, ["prefill", "decode"])
    prefill, decode = _client(pool, 0), _client(pool, 1)
    prefill.outputs = [EngineCoreOutput("", [2], FinishReason.STOP, 0)]
    outputs = asyncio.run(_served(pool, _request()))
    assert [(out.new_token_ids, out.finish_reason) for out in outputs] == [([2], FinishReason.STOP)]
    assert not decode.sent
    _assert_load_released(pool)


def test_one_token_requests_and_pools_without_a_pair_are_served_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _pool(monkeypatch, ["prefill", "decode"])
    prefill, decode = _client(pool, 0), _client(pool, 1)
    for client in (prefill, decode):
        client.outputs = [EngineCoreOutput("", [4], FinishReason.LENGTH, 0)]
    asyncio.run(_served(pool, _request(max_tokens=1)))
    (sent,) = prefill.sent + decode.sent
    assert not sent.do_remote_decode and sent.kv_transfer_handle is None
    both = _pool(monkeypatch, ["both", "both"])
    assert both.pd_engines() is None
    _assert_load_released(pool)
