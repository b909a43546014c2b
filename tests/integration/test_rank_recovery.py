"""Rank recovery under load (DESIGN.md §8): rank faults cost clients latency, never a request or a
token. A TP=2 deployment under `kvserve launch` serves 300 requests while rank 0 is killed, then
rank 1 of the next generation, then a rank of the third is frozen past the step deadline; every
stream must equal the undisturbed reference, and nothing may be left behind.
"""

import json
import os
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput, Shutdown, WorkerReady
from tests.integration.conftest import (
    KV_CACHE_MEMORY_BYTES,
    Processes,
    launch,
    start_core,
    stop_launch,
    wait_for,
)
from tests.integration.fake_rank import FakeRank
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MODEL = "checksum"
NUM_REQUESTS = 300
MAX_MODEL_LEN = 512
STEP_TIMEOUT_S = 2.0
FAULT_SHARES = (0.1, 0.3, 0.5)  # of all expected tokens received when each fault strikes
RECOVERY_TIMEOUT_S = 90.0


def _workload() -> list[tuple[list[int], SamplingParams]]:
    """Mixed lengths; greedy, seeded, and stop-token requests that may finish early."""
    rng = random.Random(12)
    shared = [rng.randrange(3, 500) for _ in range(64)]
    workload = []
    for idx in range(NUM_REQUESTS):
        prefix = shared[: rng.randrange(0, 64)] if idx % 2 else []
        prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 90))]
        max_tokens = rng.randrange(4, 80)
        match idx % 3:
            case 0:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            case 1:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=idx)
            case _:
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[7, 11, 13])
        workload.append((prompt, params))
    return workload


def _rank_pid(log: str, rank: int) -> int:
    """The pid of `rank` in the newest worker generation, from the launcher's log."""
    return int(re.findall(rf"rank {rank} joined: pid (\d+)", log)[-1])


def _num_generations_ready(log: str) -> int:
    return 1 + len(re.findall(r"worker generation \d+ ready", log))


def _received(client: EngineClient, req_ids: list[str]) -> int:
    return sum(len(client.result(req_id).token_ids) for req_id in req_ids)


def _drain_until(
    client: EngineClient, done: Callable[[], bool], timeout_s: float, what: str
) -> None:
    """Read outputs until `done()` holds, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen in {timeout_s} s")
        client.poll_outputs(0.05)


def _drain_until_received(
    client: EngineClient, req_ids: list[str], num_tokens: float, timeout_s: float, what: str
) -> None:
    """Read outputs until the requests hold at least `num_tokens` tokens, within `timeout_s`."""
    _drain_until(client, lambda: _received(client, req_ids) >= num_tokens, timeout_s, what)


@pytest.mark.timeout(420)
def test_killed_and_frozen_ranks_under_load_lose_no_request_and_no_token(
    processes: Processes, addresses: dict, ipc_folder: Path, tmp_path: Path
) -> None:
    launch(
        processes,
        addresses,
        2,
        MODEL,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--step-timeout-s",
        str(STEP_TIMEOUT_S),
        "--dist-timeout-s",
        "60",  # far past the test: a rank stuck in a collective must be ended by the engine
        "--worker-rejoin-timeout-s",
        str(RECOVERY_TIMEOUT_S),
        "--max-worker-restarts",
        "3",
    )
    workload = _workload()
    req_ids = [f"r{idx}" for idx in range(NUM_REQUESTS)]
    expected = {
        req_id: reference_generate(MODEL, prompt, params, max_model_len=MAX_MODEL_LEN)
        for req_id, (prompt, params) in zip(req_ids, workload, strict=True)
    }
    total = sum(len(tokens) for tokens in expected.values())
    recovery_s: dict[str, float] = {}
    with EngineClient(addresses["client"], 120.0) as client:
        wait_for(lambda: client.check_health(), 60, "the deployment to serve")
        for req_id, (prompt, params) in zip(req_ids, workload, strict=True):
            client.add_request(make_request(req_id, prompt, params))
        faults = [
            ("kill -9 rank 0", 0, signal.SIGKILL),
            ("kill -9 rank 1", 1, signal.SIGKILL),
            ("SIGSTOP rank 1", 1, signal.SIGSTOP),
        ]
        for share, (name, rank, signum) in zip(FAULT_SHARES, faults, strict=True):
            _drain_until_received(client, req_ids, share * total, 120, f"{share:.0%} of tokens")
            generation = _num_generations_ready(processes.log("launch"))
            os.kill(_rank_pid(processes.log("launch"), rank), signum)
            faulted = time.monotonic()
            # Tokens of steps the ranks finished before the fault may still arrive; only those
            # after the next generation is ready show that serving resumed.
            _drain_until(
                client,
                lambda seen=generation: _num_generations_ready(processes.log("launch")) > seen,
                RECOVERY_TIMEOUT_S,
                f"a new worker generation after {name}",
            )
            assert _num_generations_ready(processes.log("launch")) == generation + 1, name
            before = _received(client, req_ids)
            _drain_until_received(
                client, req_ids, before + 1, RECOVERY_TIMEOUT_S, f"a token after {name}"
            )
            recovery_s[name] = time.monotonic() - faulted
        results = client.run_until_finished(req_ids, 240)
        stats = client.get_stats()
    errors = {req_id: result.error for req_id, result in results.items() if result.error}
    assert not errors, f"clients saw errors: {list(errors.items())[:3]}"
    for req_id in req_ids:
        assert results[req_id].token_ids == expected[req_id], f"{req_id} differs from undisturbed"
    assert stats["num_worker_restarts"] == 3
    log = processes.log("launch")
    assert log.count("replacing the worker ranks") == 3
    assert "did not exit within" in log, "the frozen rank should have been killed by the engine"
    (tmp_path / "recovery_s.json").write_text(json.dumps(recovery_s))
    print(f"fault to first token after recovery, s: {recovery_s}")
    stop_launch(processes)
    assert not list(ipc_folder.glob("*.sock")), "socket files left behind"


@pytest.mark.timeout(240)
def test_standalone_ranks_rejoin_and_a_rank_too_small_for_the_pool_fails_the_engine(
    processes: Processes, addresses: dict
) -> None:
    """A standalone rank restarted by its own supervisor (here, the test) joins the next
    generation; one that offers fewer blocks than the pool holds must fail-stop, named."""
    start_core(
        processes,
        addresses,
        1,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--worker-rejoin-timeout-s",
        "60",
    )
    worker_args = [
        "--rank",
        "0",
        "-tp",
        "1",
        "--model",
        MODEL,
        "--device",
        "cpu",
        "--engine-address",
        addresses["worker"],
        "--master-port",
        addresses["master_port"],
    ]
    processes.start("worker-gen1", "worker_main", [*worker_args, *_memory(KV_CACHE_MEMORY_BYTES)])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = reference_generate(MODEL, [5, 6, 7], params, max_model_len=MAX_MODEL_LEN)
    with EngineClient(addresses["client"], 90.0) as client:
        assert _serve_one(client, "first", params) == expected
        processes.procs["worker-gen1"].send_signal(signal.SIGKILL)
        processes.wait_exit("worker-gen1", 10)
        processes.start(
            "worker-gen2", "worker_main", [*worker_args, *_memory(KV_CACHE_MEMORY_BYTES)]
        )
        assert _serve_one(client, "second", params) == expected
        processes.procs["worker-gen2"].send_signal(signal.SIGKILL)
        processes.wait_exit("worker-gen2", 10)
        small = KV_CACHE_MEMORY_BYTES // 4
        processes.start("worker-gen3", "worker_main", [*worker_args, *_memory(small)])
        assert processes.wait_exit("core", 90) == 1
    assert processes.wait_exit("worker-gen3", 30) == 1
    assert re.search(
        r"rank 0 of the new worker generation can hold \d+ blocks, expected at least the pool's",
        processes.log("core"),
    )


def _serve_one(client: EngineClient, req_id: str, params: SamplingParams) -> list[int]:
    client.add_request(make_request(req_id, [5, 6, 7], params))
    result = client.run_until_finished([req_id], 90)[req_id]
    assert result.error is None, result.error
    return result.token_ids


def _memory(num_bytes: int) -> list[str]:
    return ["--kv-cache-memory-bytes", str(num_bytes)]


@pytest.mark.timeout(90)
def test_replies_of_a_retired_generation_are_dropped_and_never_reach_a_client(
    processes: Processes, addresses: dict
) -> None:
    """A remote rank that stalls past the step deadline (SIGSTOP, a partition) and wakes after a
    new generation took over must not corrupt it: its late replies carry the old generation."""
    start_core(
        processes,
        addresses,
        1,
        "--max-model-len",
        "256",
        "--step-timeout-s",
        "1",
        "--worker-rejoin-timeout-s",
        "30",
        "--no-async-scheduling",  # the fake ranks answer one step at a time
    )
    ctx = zmq.Context()
    stale = FakeRank(ctx, addresses["worker"])
    stale.hello(0, 1, MODEL)  # host "elsewhere": the engine cannot kill it, only tell it
    config = stale.expect(KVCacheConfig)
    assert (config.generation, config.first_step_id) == (1, 1)
    stale.send(WorkerReady(0, config.num_blocks, generation=1))
    with EngineClient(addresses["client"], 30.0) as client:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        client.add_request(make_request("victim", [5, 6, 7], params))
        stale.expect(SchedulerOutput)  # and no reply: the step deadline passes
        retired = stale.expect(Shutdown)
        assert retired.is_failure and retired.generation == 1
        fresh = FakeRank(ctx, addresses["worker"])
        fresh.hello(0, 1, MODEL)
        config = fresh.expect(KVCacheConfig)
        assert (config.generation, config.first_step_id) == (2, 2)
        fresh.send(WorkerReady(0, config.num_blocks, generation=2))
        resent = fresh.expect(SchedulerOutput)
        assert (resent.step_id, resent.generation) == (2, 2)
        (new_req,) = resent.scheduled_new_reqs
        handles = pack_int32([new_req.handle])
        # the stale rank wakes: its answers to steps 1 and 2, for generation 1, must be void
        stale.send(ModelRunnerOutput(1, 0, handles, pack_int32([66]), generation=1))
        stale.send(ModelRunnerOutput(2, 0, handles, pack_int32([66]), generation=1))
        fresh.send(ModelRunnerOutput(2, 0, handles, pack_int32([41]), generation=2))
        step3 = fresh.expect(SchedulerOutput)
        fresh.send(ModelRunnerOutput(3, 0, handles, pack_int32([42]), generation=2))
        result = client.run_until_finished(["victim"], 20)["victim"]
        assert result.error is None and result.token_ids == [41, 42]
        assert step3.generation == 2
        goodbye = fresh.expect(SchedulerOutput)  # tells the rank to drop the finished request
        assert goodbye.finished_handles == [new_req.handle]
        fresh.send(ModelRunnerOutput(goodbye.step_id, 0, b"", b"", generation=2))
    # Each stale answer is dropped as it is read: as a reply while a step waits, as a frame
    # between steps or during the rejoin, whichever the timing gives; but dropped, both of them.
    stale_drop = re.compile(
        r"dropped a (?:reply|frame) from rank 0 of retired worker generation 1 "
    )
    wait_for(
        lambda: len(stale_drop.findall(processes.log("core"))) == 2,
        20,
        "the engine dropping both answers of the retired rank",
    )
    processes.procs["core"].send_signal(signal.SIGTERM)
    assert processes.wait_exit("core", 20) == 0
    assert fresh.expect(Shutdown).generation is None  # a plain stop, to whoever listens
    ctx.destroy(linger=0)
