"""Failures end cleanly: refused or missing ranks stop startup with the reason, a killed worker
fails every in-flight request and takes the deployment down, a killed engine makes workers exit.
"""

import os
import re
import signal
import socket

import pytest
import zmq

from engine_client.async_client import AsyncEngineClient, run_async
from engine_client.errors import EngineDeadError
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.buffers import pack_int32
from protocol.kv_cache_spec import KVCacheConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import (
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerReady,
)
from tests.integration.conftest import (
    Processes,
    launch,
    start_core,
    start_worker,
    stop_launch,
    wait_for,
)
from tests.integration.fake_rank import FakeRank

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_missing_rank_fails_startup_naming_it(processes: Processes, addresses: dict) -> None:
    start_core(processes, addresses, 2, "--handshake-timeout-s", "3")
    ctx = zmq.Context()
    rank0 = FakeRank(ctx, addresses["worker"])
    rank0.hello(0, 2, "checksum")
    assert rank0.expect_shutdown().is_failure
    assert processes.wait_exit("core", 30) == 1
    assert "missing rank(s) [1] of tp_size=2" in processes.log("core")
    ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_rank_missing_in_the_ready_phase_is_named_alone(
    processes: Processes, addresses: dict
) -> None:
    """Guards against a WorkerReady timeout naming every rank, the ready ones too."""
    start_core(processes, addresses, 2, "--handshake-timeout-s", "4", "--max-model-len", "256")
    ctx = zmq.Context()
    ranks = [FakeRank(ctx, addresses["worker"]) for _ in range(2)]
    for rank, fake in enumerate(ranks):
        fake.hello(rank, 2, "checksum")
    configs = [fake.expect(KVCacheConfig) for fake in ranks]
    ranks[0].send(WorkerReady(0, configs[0].num_blocks))  # rank 1 never says Ready
    assert ranks[0].expect_shutdown().is_failure
    assert processes.wait_exit("core", 30) == 1
    assert "timed out waiting for WorkerReady: missing rank(s) [1] of" in processes.log("core")
    ctx.destroy(linger=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("second_rank", "second_model", "reason"),
    [(0, "checksum", "duplicate rank 0"), (1, "tiny-llama", "runs another model than rank 0")],
)
def test_duplicate_rank_or_other_model_is_refused_without_giving_up_on_the_real_one(
    processes: Processes, addresses: dict, second_rank: int, second_model: str, reason: str
) -> None:
    """Guards against one bad hello aborting startup: only that peer is told to exit."""
    start_core(processes, addresses, 2, "--handshake-timeout-s", "4")
    ctx = zmq.Context()
    first, second = FakeRank(ctx, addresses["worker"]), FakeRank(ctx, addresses["worker"])
    first.hello(0, 2, "checksum")
    wait_for(lambda: "rank 0 joined" in processes.log("core"), 20, "rank 0 joining")
    second.hello(second_rank, 2, second_model)
    shutdown = second.expect_shutdown()
    assert shutdown.is_failure and reason in shutdown.reason, shutdown
    assert not first.sock.poll(500), "the real rank 0 was refused too"
    shutdown = first.expect_shutdown()  # only once the handshake deadline passed
    assert shutdown.is_failure and "missing rank(s) [1]" in shutdown.reason, shutdown
    assert processes.wait_exit("core", 30) == 1
    assert reason in processes.log("core")
    ctx.destroy(linger=0)


@pytest.mark.timeout(120)
def test_killing_a_worker_fails_in_flight_requests_and_stops_everything(
    processes: Processes, addresses: dict
) -> None:
    start_core(processes, addresses, 2, "--max-model-len", "1024", "--max-worker-restarts", "0")
    for rank in (0, 1):
        start_worker(processes, addresses, rank, 2, "tiny-llama")
    req_ids = [f"long-{i}" for i in range(4)]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    with EngineClient(addresses["client"], 60.0) as client:
        for i, req_id in enumerate(req_ids):
            client.add_request(make_request(req_id, [5 + i, 6, 7, 8, 9], params))
        wait_for(
            lambda: client.poll_outputs(0.1) or client.result(req_ids[0]).token_ids,
            60,
            "the first tokens",
        )
        victim = int(re.search(r"rank 1 joined: pid (\d+)", processes.log("core")).group(1))
        os.kill(victim, signal.SIGKILL)
        results = client.run_until_finished(req_ids, 30)
    for req_id in req_ids:
        assert results[req_id].finish_reason == "error", results[req_id]
        assert "rank 1" in results[req_id].error, results[req_id].error
    assert processes.wait_exit("core", 15) == 1
    assert processes.wait_exit("worker-0", 30) != 0
    assert processes.wait_exit("worker-1", 5) == -signal.SIGKILL


@pytest.mark.timeout(90)
def test_killing_the_engine_makes_every_worker_exit(processes: Processes, addresses: dict) -> None:
    start_core(processes, addresses, 2)
    for rank in (0, 1):
        start_worker(processes, addresses, rank, 2, "checksum")
    with EngineClient(addresses["client"], 60.0) as client:
        assert client.check_health() is True
        processes.procs["core"].send_signal(signal.SIGKILL)
        assert processes.wait_exit("core", 10) == -signal.SIGKILL
        with pytest.raises(EngineDeadError, match="disconnected"):
            client.get_stats()
        # the monitor reports the disconnect once; a later call must not wait out its deadline
        with pytest.raises(EngineDeadError, match="disconnected"):
            client.call_utility("get_stats", timeout_s=30.0)
    for rank in (0, 1):
        assert processes.wait_exit(f"worker-{rank}", 20) == 1
        assert "disconnected" in processes.log(f"worker-{rank}")


@pytest.mark.timeout(90)
def test_async_client_of_a_killed_engine_gets_engine_dead_error(
    processes: Processes, addresses: dict
) -> None:
    """A waiter, and every call made after the disconnect, fail at once rather than time out."""
    launch(processes, addresses, 1, "checksum", "--max-model-len", "8192")

    async def outlive_the_engine() -> tuple[str, str]:
        client = AsyncEngineClient(addresses["client"], 60.0)
        try:
            assert await client.call_utility("check_health") is True
            params = SamplingParams(max_tokens=8000, ignore_eos=True)
            stream = client.generate(make_request("doomed", [5, 6, 7], params))
            await anext(stream)  # the request runs
            engine_pid = int(re.search(r"engine-core \(pid (\d+)\)", processes.log("launch"))[1])
            os.kill(engine_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError) as waiter:
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError) as later:
                await client.call_utility("get_stats")
            return str(waiter.value), str(later.value)
        finally:
            await client.close()

    waiter_error, later_error = run_async(outlive_the_engine())  # type: ignore[misc]
    assert "disconnected" in waiter_error and "disconnected" in later_error
    assert processes.wait_exit("launch", 30) == 1


@pytest.mark.timeout(90)
def test_a_silent_engine_makes_the_worker_exit(processes: Processes, addresses: dict) -> None:
    """SIGSTOP keeps the engine's sockets open, so only the worker's heartbeats can tell."""
    start_core(processes, addresses, 1, "--max-worker-restarts", "0")
    start_worker(processes, addresses, 0, 1, "checksum", "--engine-timeout-s", "3")
    with EngineClient(addresses["client"], 60.0) as client:
        assert client.check_health() is True
    processes.procs["core"].send_signal(signal.SIGSTOP)
    try:
        assert processes.wait_exit("worker-0", 30) == 1
    finally:
        processes.procs["core"].send_signal(signal.SIGCONT)
    assert "disconnected" in processes.log("worker-0")
    assert processes.wait_exit("core", 30) == 1  # woken, the engine finds its only rank gone


def test_fake_rank_host_is_not_this_host() -> None:
    """The fake ranks claim another host, so the engine watches them by heartbeat, not by pid."""
    assert socket.gethostname() != "elsewhere"


@pytest.mark.timeout(120)
def test_a_hung_worker_misses_the_step_deadline_and_the_launcher_tears_down(
    processes: Processes, addresses: dict
) -> None:
    """SIGSTOP leaves the process and its sockets alive, so only the step deadline can see it.

    Rank 0 misses the deadline too: it waits in the all-reduce for its stopped peer.
    """
    launch(
        processes,
        addresses,
        2,
        "checksum",
        "--step-timeout-s",
        "2",
        "--shutdown-timeout-s",
        "1",  # the launcher's grace for the stopped rank: this, its 5 s join, then SIGTERM
        "--max-model-len",
        "8192",
        "--max-worker-restarts",
        "0",
    )
    params = SamplingParams(max_tokens=8000, ignore_eos=True)
    with EngineClient(addresses["client"], 60.0) as client:
        client.add_request(make_request("endless", [5, 6, 7], params))
        wait_for(
            lambda: client.poll_outputs(0.1) or client.result("endless").token_ids,
            60,
            "the first tokens",
        )
        victim = int(re.search(r"rank 1 joined: pid (\d+)", processes.log("launch")).group(1))
        os.kill(victim, signal.SIGSTOP)
        result = client.run_until_finished(["endless"], 30)["endless"]
    assert result.finish_reason == "error"
    assert re.search(r"no reply to step \d+ from rank\(s\) \[(0, )?1\]", result.error), result.error
    assert processes.wait_exit("launch", 60) == 1


@pytest.mark.timeout(90)
def test_ctrl_c_stops_the_whole_deployment_cleanly(processes: Processes, addresses: dict) -> None:
    """Ctrl-C signals the terminal's whole process group: the launcher, the engine and the
    workers at once. The workers leave it to the engine, which stops them with a Shutdown."""
    launch(processes, addresses, 2, "checksum", new_session=True)
    with EngineClient(addresses["client"], 60.0) as client:
        assert client.check_health() is True
    os.killpg(processes.procs["launch"].pid, signal.SIGINT)
    assert processes.wait_exit("launch", 30) == 0, processes.log("launch")[-3000:]
    log = processes.log("launch")
    assert "engine stopped after" in log, log[-3000:]
    assert log.count("stopping: the engine is shutting down") == 2, log[-3000:]


@pytest.mark.timeout(60)
def test_a_worker_joining_after_startup_is_refused_and_serving_goes_on(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 1, "checksum")
    with EngineClient(addresses["client"], 60.0) as client:
        assert client.check_health() is True
        ctx = zmq.Context()
        latecomer = FakeRank(ctx, addresses["worker"])
        latecomer.hello(0, 1, "checksum")
        shutdown = latecomer.expect_shutdown()
        assert shutdown.is_failure and "already serves all 1 ranks" in shutdown.reason
        ctx.destroy(linger=0)  # the latecomer disconnects; the engine must not mind
        params = SamplingParams(max_tokens=4)
        result = client.run_until_finished(
            [client.add_request(make_request("after", [5, 6], params)).req_id], 30
        )
        assert result["after"].error is None and len(result["after"].token_ids) == 4
    stop_launch(processes)


@pytest.mark.timeout(60)
def test_ranks_that_sample_different_tokens_stop_the_engine_naming_them(
    processes: Processes, addresses: dict
) -> None:
    """Two fake ranks finish the handshake, then rank 1 samples other tokens than rank 0."""
    # the fake ranks answer one step at a time, so the engine waits for each answer
    start_core(processes, addresses, 2, "--max-model-len", "256", "--no-async-scheduling")
    ctx = zmq.Context()
    ranks = [FakeRank(ctx, addresses["worker"]) for _ in range(2)]
    for rank, fake in enumerate(ranks):
        fake.hello(rank, 2, "checksum")
    for rank, fake in enumerate(ranks):
        config = fake.expect(KVCacheConfig)
        fake.send(WorkerReady(rank, config.num_blocks))
    with EngineClient(addresses["client"], 30.0) as client:
        client.add_request(make_request("victim", [5, 6, 7], SamplingParams(max_tokens=4)))
        for rank, fake in enumerate(ranks):
            step = fake.expect(SchedulerOutput)
            handles = pack_int32(req.handle for req in step.scheduled_new_reqs)
            fake.send(ModelRunnerOutput(step.step_id, rank, handles, pack_int32([10 + rank])))
        result = client.run_until_finished(["victim"], 20)["victim"]
    assert result.finish_reason == "error"
    assert "rank(s) [1] differ from rank 0" in result.error, result.error
    assert processes.wait_exit("core", 15) == 1
    for fake in ranks:
        assert fake.expect(Shutdown).is_failure
    ctx.destroy(linger=0)
