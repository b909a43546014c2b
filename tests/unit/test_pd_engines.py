"""Disaggregated prefill and decode in one process: a prefill EngineCore and a decode EngineCore,
each over a real ModelRunner, their ranks joined through KVTransferRank's transport seam.

The front end's part is played here: the request goes to the prefill engine with max_tokens 1
and do_remote_decode, its handle goes on to the decode engine, and the handle is released once
the decode engine answers. The served tokens must equal the unpaged reference (one engine's), the
decode engine must have pulled (its prefix hit covers the pulled blocks), and both pools must end
idle. Faults: a forged handle, a handle released before the pull, and one never pulled.
"""

import copy
import dataclasses
import random
from pathlib import Path

import msgspec
import pytest
import torch
from in_process_engine import engine_config, model_runner

from engine_core.core import EngineCore
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import KVTransferHandle, kv_transfer_layout
from protocol.sampling import SamplingParams
from tests.unit.hf_checkpoints import (
    GEMMA2_ALTERNATING,
    GEMMA3_FIVE_TO_ONE,
    hf_greedy,
    write_checkpoint,
)
from tests.unit.test_hf_generate import MARGIN_TOL
from worker.kv_cache import shared_kv_tensors
from worker.kv_transfer import KVPullError, KVTransferRank
from worker.models.fake.reference import reference_generate
from worker.models.registry import get_model_info

CPU = torch.device("cpu")
MAX_MODEL_LEN = 96
ENDPOINT = "inproc://prefill-rank-0"
PARAMS = [
    SamplingParams(max_tokens=9, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.8, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class JoinedRank(KVTransferRank):
    """A decode rank whose pulls reach the prefill rank of this process directly, or fail when
    that rank is gone (`peer` None): the transport seam, with the server's own checks."""

    peer: KVTransferRank | None = None

    def exchange(self, endpoint: str, frame: bytes) -> list[bytes]:
        if self.peer is None or endpoint != ENDPOINT:
            raise KVPullError(f"no answer from {endpoint}")
        return self.peer.answer(frame)


@dataclasses.dataclass
class Pair:
    prefill: EngineCore
    decode: EngineCore
    prefill_rank: KVTransferRank
    decode_rank: JoinedRank


def _engine(
    model: str,
    block_size: int,
    num_blocks: int,
    role: str,
    rank_type: type[KVTransferRank],
    async_scheduling: bool,
) -> tuple[EngineCore, KVTransferRank]:
    info = get_model_info(model, block_size)
    kv_cache_config = KVCacheConfig(num_blocks, info.kv_cache_groups)
    runner = model_runner(
        model, kv_cache_config, CPU, info.max_model_len, eos_token_ids=info.eos_token_ids
    )
    layout = kv_transfer_layout(info.name, kv_cache_config, 1)
    rank = rank_type(0, shared_kv_tensors(kv_cache_config, runner.kv_caches, 1), layout)
    runner.kv_transfer = rank
    config = engine_config(
        block_size,
        max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
    )
    config = msgspec.structs.replace(config, kv_role=role, kv_transfer_timeout_s=5.0)
    return EngineCore(config, kv_cache_config, info, runner), rank


def _pair(
    model: str,
    block_size: int,
    decode_blocks: int,
    async_scheduling: bool = True,
    prefill_blocks: int = 64,
) -> Pair:
    prefill, prefill_rank = _engine(
        model, block_size, prefill_blocks, "prefill", KVTransferRank, async_scheduling
    )
    decode, decode_rank = _engine(
        model, block_size, decode_blocks, "decode", JoinedRank, async_scheduling
    )
    assert isinstance(decode_rank, JoinedRank)
    decode_rank.peer = prefill_rank
    prefill.kv_transfer.set_endpoints([ENDPOINT])
    return Pair(prefill, decode, prefill_rank, decode_rank)


def _run(core: EngineCore, sink: dict[str, list[EngineCoreOutput]]) -> None:
    for _ in range(2000):
        if not core.has_work():
            return
        for outputs in core.step().values():
            for output in outputs.outputs:
                sink.setdefault(output.req_id, []).append(output)
    raise AssertionError("the engine did not finish")


def _prompts(count: int) -> list[list[int]]:
    """Prompts of 8..70 tokens; two in three share a prefix, so the prefill side hits."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(50)]
    return [
        (shared[: rng.randrange(8, 50)] if idx % 3 else [])
        + [rng.randrange(3, 500) for _ in range(rng.randrange(3, 20))]
        for idx in range(count)
    ]


def _prefill_all(
    pair: Pair, prompts: list[list[int]]
) -> tuple[dict[str, KVTransferHandle | None], dict[str, EngineCoreRequest]]:
    """Each prompt through the prefill engine: its handle (None: it ended there) by req_id."""
    requests = {}
    for idx, prompt in enumerate(prompts):
        params = PARAMS[idx % len(PARAMS)]
        request = EngineCoreRequest(f"r{idx}", pack_int32(prompt), params, float(idx))
        requests[request.req_id] = request
        prefill_params = msgspec.structs.replace(params, max_tokens=1, min_tokens=0)
        prefill_request = msgspec.structs.replace(
            request, sampling_params=prefill_params, do_remote_decode=True
        )
        assert pair.prefill.add_request(prefill_request) is None
    outputs: dict[str, list[EngineCoreOutput]] = {}
    _run(pair.prefill, outputs)
    handles = {}
    for req_id, outs in outputs.items():
        assert outs[-1].finish_reason is not None
        handles[req_id] = outs[-1].kv_transfer_handle
    return handles, requests


def _decode_all(
    pair: Pair, requests: dict[str, EngineCoreRequest], handles: dict[str, KVTransferHandle | None]
) -> dict[str, list[EngineCoreOutput]]:
    for req_id, request in requests.items():
        decode_request = msgspec.structs.replace(request, kv_transfer_handle=handles[req_id])
        assert pair.decode.add_request(decode_request) is None
    outputs: dict[str, list[EngineCoreOutput]] = {}
    _run(pair.decode, outputs)
    for handle in handles.values():
        if handle is not None:
            pair.prefill.kv_transfer.release(handle.transfer_id, handle.secret)
    _run(pair.prefill, {})  # the unpins go out
    return outputs


def _assert_reference(
    model: str, prompts: list[list[int]], outputs: dict[str, list[EngineCoreOutput]]
) -> None:
    for idx, prompt in enumerate(prompts):
        tokens = [token for out in outputs[f"r{idx}"] for token in out.new_token_ids]
        params = PARAMS[idx % len(PARAMS)]
        assert tokens == reference_generate(model, prompt, params, max_model_len=MAX_MODEL_LEN)
        assert outputs[f"r{idx}"][-1].finish_reason is not None


def _assert_idle(core: EngineCore) -> None:
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "blocks are still held"
    assert not core.scheduler.requests
    core.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("model", "block_size", "decode_blocks"), [("checksum", 4, 26), ("tiny-llama", 16, 9)]
)
def test_one_prefill_one_decode_serve_the_single_engine_tokens(
    model: str, block_size: int, decode_blocks: int, async_scheduling: bool
) -> None:
    """Prefix hits on the prefill side, preemption on the small decode side: the tokens are
    one engine's, the decode engine computed only what it did not pull, and both pools end
    idle with every transfer released."""
    pair = _pair(model, block_size, decode_blocks, async_scheduling)
    prompts = _prompts(7)
    handles, requests = _prefill_all(pair, prompts)
    assert all(handle is not None for handle in handles.values())
    assert pair.prefill.scheduler.make_stats().prefix_cache.hits > 0
    pins = pair.prefill.kv_transfer.pins
    assert pins is not None and pins.num_held_blocks > 0
    outputs = _decode_all(pair, requests, handles)
    _assert_reference(model, prompts, outputs)
    pulls = pair.decode.kv_transfer.pulls
    assert pulls is not None and pulls.stats.num_pulls > 0 and pulls.stats.num_failed == 0
    assert pair.decode.scheduler.num_preemptions > 0, "the small decode pool should preempt"
    assert any(outs[0].num_cached_tokens > 0 for outs in outputs.values())
    assert pins.num_released == len(handles) and pins.num_held_blocks == 0
    assert pair.prefill_rank.num_served == pulls.stats.num_pulls
    _assert_idle(pair.prefill)
    _assert_idle(pair.decode)


def test_forged_stale_and_lost_handles_cost_the_transfer_not_the_tokens() -> None:
    """A forged secret, another engine's blocks, a handle already released and a prefill rank
    that is gone: each pull is refused or fails, is counted, and the decode engine computes the
    prompt itself; the tokens stay exact."""
    pair = _pair("checksum", 4, 40)
    prompts = _prompts(4)
    handles, requests = _prefill_all(pair, prompts)
    h0, h1, h2 = handles["r0"], handles["r1"], handles["r2"]
    assert h0 is not None and h1 is not None and h2 is not None
    handles["r0"] = msgspec.structs.replace(h0, secret="0" * 32)  # forged
    other_blocks = [block_id + 1 for block_id in h1.block_ids]  # blocks it does not own
    handles["r1"] = msgspec.structs.replace(h1, block_ids=other_blocks)
    assert pair.prefill.kv_transfer.release(h2.transfer_id, h2.secret) == (True, None)
    _run(pair.prefill, {})  # the unpin reaches the rank: r2's handle is now stale
    outputs = _decode_all(pair, requests, handles)
    _assert_reference("checksum", prompts, outputs)
    pins = pair.prefill.kv_transfer.pins
    # the releases of the forged secret and of r2, released already, are refused
    assert pins is not None and pins.num_refused_releases == 2
    assert pair.prefill.kv_transfer.release(h0.transfer_id, h0.secret) == (True, None)
    pulls = pair.decode.kv_transfer.pulls
    assert pulls is not None and pulls.stats.num_failed == 3
    assert pair.prefill_rank.num_refused == 3
    assert pins.num_refused_pulls == 3  # the ranks' refusals, reported with the prefill steps
    # the prefill rank is gone: the next request's pull fails and it is computed here
    fresh = [[token + 1 for token in prompt] for prompt in prompts[:2]]
    handles, requests = _prefill_all(pair, fresh)
    pair.decode_rank.peer = None
    outputs = _decode_all(pair, requests, handles)
    _assert_reference("checksum", fresh, outputs)
    assert pulls.stats.num_failed == 5
    _assert_idle(pair.prefill)
    _assert_idle(pair.decode)


def test_a_handle_never_pulled_is_freed_at_its_deadline() -> None:
    """The decode side never asks: at the deadline the blocks go back to the prefix cache and
    the ranks stop serving them."""
    pair = _pair("checksum", 4, 40)
    now = [0.0]
    pins = pair.prefill.kv_transfer.pins
    assert pins is not None
    pins.clock = lambda: now[0]
    handles, _ = _prefill_all(pair, _prompts(3))
    assert pins.num_held_blocks > 0 and len(pins.held) == 3
    assert pair.prefill.kv_transfer.expire() == 0
    now[0] += 5.0
    assert pair.prefill.kv_transfer.expire() == 3
    assert pair.prefill.has_work(), "the unpins must go out with a step"
    _run(pair.prefill, {})
    assert pins.num_expired == 3 and pins.num_held_blocks == 0
    _assert_idle(pair.prefill)
    handle = handles["r0"]
    assert handle is not None
    assert pair.prefill.kv_transfer.release(handle.transfer_id, handle.secret)[0] is False


def test_a_request_that_stops_at_its_first_token_holds_nothing() -> None:
    """A stop token sampled first ends the request on the prefill engine: no handle, no pin."""
    pair = _pair("checksum", 4, 40)
    prompt = _prompts(1)[0]
    first = reference_generate("checksum", prompt, PARAMS[0], max_model_len=MAX_MODEL_LEN)[0]
    params = SamplingParams(max_tokens=1, stop_token_ids=[first])
    request = EngineCoreRequest("r0", pack_int32(prompt), params, 0.0, do_remote_decode=True)
    assert pair.prefill.add_request(request) is None
    outputs: dict[str, list[EngineCoreOutput]] = {}
    _run(pair.prefill, outputs)
    assert outputs["r0"][-1].finish_reason == FinishReason.STOP
    assert outputs["r0"][-1].kv_transfer_handle is None
    _assert_idle(pair.prefill)


def test_parked_requests_are_aborted_failed_and_counted_like_queued_ones() -> None:
    """A request parked for its pull is live: an abort ends it (its pull, once sent, still
    settles), a failure of the engine fails it with the reason, and neither leaks a block."""
    pair = _pair("checksum", 4, 26)
    handles, requests = _prefill_all(pair, _prompts(3)[1:])
    decode = pair.decode
    for req_id, request in requests.items():
        with_handle = msgspec.structs.replace(request, kv_transfer_handle=handles[req_id])
        assert decode.add_request(with_handle) is None
    assert decode.num_unfinished_requests == 2 and decode.is_live(b"", "r0")
    (aborted,) = decode.abort_requests(["r0"]).values()
    assert [(out.req_id, out.finish_reason) for out in aborted.outputs] == [
        ("r0", FinishReason.ABORT)
    ]
    decode.step()  # r1's pull goes out
    (failed,) = decode.fail_all("the ranks are gone").values()
    assert [(out.req_id, out.finish_reason, out.error) for out in failed.outputs] == [
        ("r1", FinishReason.ERROR, "the ranks are gone")
    ]
    assert not decode.has_unfinished_requests()
    _assert_idle(decode)


@pytest.mark.parametrize(
    ("arch", "fields", "block_size", "num_blocks", "num_groups"),
    [
        ("llama", {}, 16, 64, 1),
        # hybrids, one pool: a full-attention group beside sliding-window groups (window 6 over
        # blocks of 4, so each window group's hit needs its last two blocks before the hit)
        ("gemma2", GEMMA2_ALTERNATING, 4, 512, 3),
        ("gemma3", GEMMA3_FIVE_TO_ONE, 4, 512, 6),
    ],
    ids=["llama", "gemma2", "gemma3"],
)
def test_a_real_checkpoint_through_prefill_and_decode_matches_transformers(
    tmp_path: Path, arch: str, fields: dict, block_size: int, num_blocks: int, num_groups: int
) -> None:
    """A random float32 checkpoint: the decode engine's greedy tokens, computed over the pulled
    KV, are transformers' generate()'s, up to a step whose top-2 margin is a near-tie. For the
    Gemma hybrids every KV-cache group's blocks move (each window group's only within the
    window the hit needs) and the decode engine computes only the prompt's last block."""
    model = write_checkpoint(tmp_path / arch, arch, seed=3, **copy.deepcopy(fields))
    folder = str(tmp_path / arch)
    pair = _pair(folder, block_size, num_blocks, prefill_blocks=num_blocks)
    prompts = [[token % 256 for token in prompt[:40]] for prompt in _prompts(4)]  # its vocabulary
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = {}
    for idx, prompt in enumerate(prompts):
        request = EngineCoreRequest(f"r{idx}", pack_int32(prompt), params, float(idx))
        requests[request.req_id] = request
        first = msgspec.structs.replace(params, max_tokens=1)
        prefill_request = msgspec.structs.replace(
            request, sampling_params=first, do_remote_decode=True
        )
        assert pair.prefill.add_request(prefill_request) is None
    prefilled: dict[str, list[EngineCoreOutput]] = {}
    _run(pair.prefill, prefilled)
    handles = {req_id: outs[-1].kv_transfer_handle for req_id, outs in prefilled.items()}
    outputs = _decode_all(pair, requests, handles)
    pulls = pair.decode.kv_transfer.pulls
    assert pulls is not None and pulls.stats.num_pulls > 0 and pulls.stats.num_failed == 0
    assert pulls.stats.num_skipped == sum(len(p) <= block_size for p in prompts), pulls.stats
    assert pair.decode.kv_transfer.layout.num_kv_cache_groups == num_groups
    for idx, prompt in enumerate(prompts):
        # the hit every group agrees on is the pulled one: all of the prompt but its last block
        hit = (len(prompt) - 1) // block_size * block_size
        assert outputs[f"r{idx}"][0].num_cached_tokens == hit, f"request {idx}"
        served = [token for out in outputs[f"r{idx}"] for token in out.new_token_ids]
        expected, margins = hf_greedy(model, prompt, len(served))
        first_diff = next(
            (j for j, (a, b) in enumerate(zip(served, expected, strict=True)) if a != b), None
        )
        assert first_diff is None or margins[first_diff] < MARGIN_TOL, (served, expected)
    _assert_idle(pair.prefill)
    _assert_idle(pair.decode)


def test_a_lost_worker_generation_drops_pins_and_requeues_parked_requests() -> None:
    """The pages were the old ranks': a prefill engine forgets its pins (their handles refused
    from then on), a decode engine fails its pulls and queues their requests to compute."""
    pair = _pair("checksum", 4, 26)
    handles, requests = _prefill_all(pair, _prompts(3)[1:])
    pins = pair.prefill.kv_transfer.pins
    assert pins is not None and pins.num_held_blocks > 0
    pair.prefill.requeue_for_new_workers()
    assert pins.num_held_blocks == 0 and not pins.held
    handle = handles["r0"]
    assert handle is not None
    assert pair.prefill.kv_transfer.release(handle.transfer_id, handle.secret)[0] is False
    pair.prefill.check_invariants()
    decode = pair.decode
    for req_id, request in requests.items():
        with_handle = msgspec.structs.replace(request, kv_transfer_handle=handles[req_id])
        assert decode.add_request(with_handle) is None
    pulls = decode.kv_transfer.pulls
    assert pulls is not None and len(pulls.parked) == 2 and not decode.scheduler.requests
    decode.requeue_for_new_workers()
    assert not pulls.parked and pulls.stats.num_failed == 2
    assert sorted(request.client_req_id for request in decode.scheduler.requests.values()) == [
        "r0",
        "r1",
    ]
    decode.check_invariants()
