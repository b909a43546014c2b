"""Operators' mistakes against real processes: a second deployment on the same addresses, a port in
use, SIGTERM to the whole process group, and garbage on the worker socket during startup.
"""

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import zmq

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import EPHEMERAL_RANGE_FILE, choosable_ports
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    KV_CACHE_MEMORY_BYTES,
    Processes,
    free_tcp_ports,
    launch,
    start_core,
    start_worker,
    stop_launch,
    wait_for,
)
from tests.integration.hostile import MODEL, assert_served_exactly, raw_dealer
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

FAST_EXIT_S = 15  # a refused start exits at once; this only bounds a slow, loaded machine


def _launch_args(tp_size: int, addresses: dict) -> list[str]:
    """`kvserve launch` at the test's addresses, with no --master-port (its default is used)."""
    return [
        "launch", "-tp", str(tp_size), "--model", MODEL, "--device", "cpu",
        "--client-address", addresses["client"], "--worker-address", addresses["worker"],
        "--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
    ]  # fmt: skip


def _assert_one_line_usage_error(log: str, *needles: str) -> None:
    assert "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if " ERROR " in line or "error:" in line]
    assert errors and all(needle in errors[-1] for needle in needles), log[-3000:]


@pytest.mark.timeout(120)
def test_a_second_deployment_on_the_same_ipc_addresses_is_refused(
    processes: Processes, addresses: dict, tmp_path: Path
) -> None:
    """Defect 9: a second deployment bound the same ipc paths silently, took the new clients, and
    on exit unlinked the first one's socket files, leaving it running but unreachable."""
    launch(processes, addresses, 1, MODEL)
    assert_served_exactly(addresses["client"], "first")
    processes.start("second", "kvserve_main", _launch_args(1, addresses))
    assert processes.wait_exit("second", FAST_EXIT_S) == 2
    _assert_one_line_usage_error(processes.log("second"), "--client-address", "in use")
    core = ["-tp", "1", "--client-address", f"ipc://{tmp_path}/other.sock"]
    processes.start("core-2", "core_main", [*core, "--worker-address", addresses["worker"]])
    assert processes.wait_exit("core-2", FAST_EXIT_S) == 2  # the engine's own check
    _assert_one_line_usage_error(processes.log("core-2"), "--worker-address", "in use")
    for address in (addresses["client"], addresses["worker"]):
        assert Path(address.removeprefix("ipc://")).exists(), f"{address} was unlinked"
    assert not Path(f"{tmp_path}/other.sock").exists(), "the refused engine left its file"
    assert_served_exactly(addresses["client"], "first-again")
    stop_launch(processes)
    for address in (addresses["client"], addresses["worker"]):
        assert not Path(address.removeprefix("ipc://")).exists(), f"{address} left behind"


@pytest.mark.timeout(120)
def test_a_busy_rendezvous_port_fails_at_once_or_is_replaced_when_it_is_the_default(
    processes: Processes, addresses: dict
) -> None:
    """Defect 9: a TP launch on a rendezvous port in use failed only after 25 s."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(addresses["master_port"])))
        busy.listen()
        launch(processes, addresses, 2, MODEL)
        assert processes.wait_exit("launch", FAST_EXIT_S) == 2
    _assert_one_line_usage_error(processes.log("launch"), "--master-port", "in use")
    with socket.socket() as default_port:
        try:
            default_port.bind(("127.0.0.1", 29500))
        except OSError:
            pytest.skip("the default rendezvous port 29500 is held by another process here")
        default_port.listen()
        processes.start("launch", "kvserve_main", _launch_args(2, addresses))
        assert_served_exactly(addresses["client"], "moved-port")
    assert "rendezvous port 29500 is taken" in processes.log("launch")
    stop_launch(processes)


@pytest.mark.timeout(30)
def test_chosen_ports_are_free_and_outside_the_ephemeral_range() -> None:
    """A CI run lost the engine's client port, chosen by a bind to port 0, to another socket
    the kernel handed it to before the engine bound it: chosen ports avoid that range."""
    ranges = Path(EPHEMERAL_RANGE_FILE)
    if not ranges.exists():
        pytest.skip(f"no {EPHEMERAL_RANGE_FILE}: the kernel's choice is all there is")
    low, high = (int(field) for field in ranges.read_text().split())
    ports = free_tcp_ports(16)
    assert len(set(ports)) == len(ports)
    if choosable_ports(ranges.read_text()) is not None:
        assert [port for port in ports if low <= port <= high] == []
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flag", ["--client-address", "--metrics-port"])
def test_a_port_in_use_is_one_line_and_exit_2(
    processes: Processes, addresses: dict, flag: str
) -> None:
    """Defect 10: a port in use gave a traceback after about 10 s and could leave files."""
    port, other = free_tcp_ports(2)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", port))
        busy.listen()
        extra = ["--metrics-port", str(port)] if flag == "--metrics-port" else []
        client = f"tcp://127.0.0.1:{port if flag == '--client-address' else other}"
        args = ["-tp", "1", "--client-address", client, "--worker-address", addresses["worker"]]
        start = time.monotonic()
        processes.start("core", "core_main", [*args, *extra])
        assert processes.wait_exit("core", FAST_EXIT_S) == 2
        assert time.monotonic() - start < FAST_EXIT_S
    _assert_one_line_usage_error(processes.log("core"), flag, str(port))
    assert not Path(addresses["worker"].removeprefix("ipc://")).exists()


@pytest.mark.timeout(120)
def test_sigterm_to_the_process_group_drains_in_flight_requests_and_exits_0(
    processes: Processes, addresses: dict
) -> None:
    """Defect 11: SIGTERM to the process group (a container stop) ended with exit 1 and "worker
    failure", because the workers died first."""
    launch(processes, addresses, 2, MODEL, new_session=True)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompts = {f"drain-{i}": [20 + i, 5, 6, 7] for i in range(4)}
    with EngineClient(addresses["client"], 60.0) as client:
        for req_id, prompt in prompts.items():
            client.add_request(make_request(req_id, prompt, params))
        wait_for(lambda: client.poll_outputs(0.1) or client.result("drain-0").token_ids, 30, "go")
        os.killpg(processes.procs["launch"].pid, signal.SIGTERM)
        results = client.run_until_finished(list(prompts), 60)
    for req_id, prompt in prompts.items():
        assert results[req_id].error is None, results[req_id].error
        assert results[req_id].token_ids == reference_generate(MODEL, prompt, params)
    assert processes.wait_exit("launch", 60) == 0, processes.log("launch")[-3000:]
    log = processes.log("launch")
    assert "stopping: no new requests; draining" in log, log[-3000:]
    assert log.count("stopping: the engine is shutting down") == 2, log[-3000:]
    assert "worker failure" not in log


@pytest.mark.timeout(120)
def test_requests_still_running_at_the_shutdown_deadline_end_with_the_reason(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 1, MODEL, "--shutdown-timeout-s", "0.5", "--max-model-len", "4096")
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    with EngineClient(addresses["client"], 60.0) as client:
        result = client.add_request(make_request("endless", [3, 4, 5], params))
        wait_for(lambda: client.poll_outputs(0.1) or result.token_ids, 30, "first tokens")
        processes.procs["launch"].send_signal(signal.SIGTERM)
        client.run_until_finished(["endless"], 30)
    assert result.finish_reason == "error" and "shutting down" in (result.error or ""), result
    assert processes.wait_exit("launch", 30) == 0, processes.log("launch")[-3000:]


@pytest.mark.timeout(120)
def test_garbage_on_the_worker_socket_during_startup_is_dropped(
    processes: Processes, addresses: dict
) -> None:
    """Defect 12: garbage or an unexpected hello on the worker socket aborted startup."""
    start_core(processes, addresses, 1)
    ctx = zmq.Context()
    stray = raw_dealer(ctx, addresses["worker"])
    for frame in (b"\xc1 junk", b"\x91" * 1000 + b"\x00", b"", b"\x81\xa4type\xa3Bad"):
        stray.send(frame)
    stray.send_multipart([b"two", b"frames"])
    wait_for(lambda: "dropped a frame" in processes.log("core"), 20, "the engine to drop them")
    start_worker(processes, addresses, 0, 1, MODEL)
    assert_served_exactly(addresses["client"], "after-garbage")
    ctx.destroy(linger=0)
    processes.procs["core"].terminate()
    assert processes.wait_exit("core", 30) == 0
    assert processes.wait_exit("worker-0", 30) == 0
