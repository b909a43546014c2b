"""Across hosts: an engine, two TP ranks and a client, each in a network namespace of its own,
talk only over tcp on a bridged private subnet, with CURVE keys, and serve the reference tokens;
with one rank's link cut mid-run, the engine replaces the worker generation and every request
still ends with the reference tokens.
"""

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy.keys import load_curve_keys
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, wait_for
from tests.integration.netns import (
    Host,
    NetworkNamespaces,
    console_script,
    start_in,
    why_namespaces_cannot_be_made,
)
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MODEL = "checksum"
TP_SIZE = 2
RANKS = tuple(range(TP_SIZE))
KV_CACHE_MEMORY_BYTES = 1 << 22  # per rank
CLIENT_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 60.0  # torch's import alone takes seconds on a loaded 2-core host
STOP_TIMEOUT_S = 30.0
CUT_GRACE_S = 6.0  # a cut-off worker exits on its own (engine silence) or is killed after this
MAX_RESTARTS_PER_RANK = 4
POLL_S = 0.05
FIRST_TOKENS = "first tokens"  # the client prints this once outputs flow
# Short deadlines, so that a lost rank is noticed and replaced within seconds.
FAST_ENGINE_FLAGS = [
    "--heartbeat-interval-s",
    "0.2",
    "--heartbeat-timeout-s",
    "1",
    "--step-timeout-s",
    "3",
    "--worker-rejoin-timeout-s",
    "40",
]
FAST_WORKER_FLAGS = ["--engine-timeout-s", "3", "--dist-timeout-s", "8"]
LOAD_MAX_TOKENS = 200  # enough steps that the cut lands while every request still runs


def serve_batch(address: str, keys_dir: str, batch_file: str, results_file: str) -> None:
    """The client's process main: submit every request of `batch_file`, print FIRST_TOKENS once
    the first outputs arrive, wait for all of them, and write each one's tokens and error."""
    batch = json.loads(Path(batch_file).read_text())
    keys = load_curve_keys(Path(keys_dir), "client")
    with EngineClient(address, CLIENT_TIMEOUT_S, keys) as client:
        for req_id, (prompt, max_tokens) in batch.items():
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            client.add_request(make_request(req_id, prompt, params))
        # The engine's liveness probes are empty outputs: wait for a token, not for any frame.
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while not any(client.result(req_id).token_ids for req_id in batch):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no tokens from the engine at {address} in {CLIENT_TIMEOUT_S} s"
                )
            client.poll_outputs(POLL_S)  # it raises when the engine is gone
        print(FIRST_TOKENS, flush=True)
        results = client.run_until_finished(list(batch), CLIENT_TIMEOUT_S)
    answers = {r.req_id: {"token_ids": r.token_ids, "error": r.error} for r in results.values()}
    Path(results_file).write_text(json.dumps(answers))


@pytest.fixture(scope="module", autouse=True)
def namespaces_can_be_made() -> None:
    reason = why_namespaces_cannot_be_made()  # probed once for the module
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def network() -> Iterator[NetworkNamespaces]:
    """Hosts engine, rank0, rank1 and client on one bridge; removed after the test."""
    network = NetworkNamespaces()
    try:
        network.add_hub()
        for name in ("engine", *(f"rank{rank}" for rank in RANKS), "client"):
            network.add_host(name)
        yield network
    finally:
        network.close()


@pytest.fixture
def deployment(
    network: NetworkNamespaces, processes: Processes, tmp_path: Path
) -> Iterator["Deployment"]:
    deployment = Deployment(processes, network, tmp_path / "keys")
    yield deployment
    processes.kill_all()  # after a failure only: a test that passed has stopped every process


@dataclass
class Deployment:
    """kvserve-core on host `engine`, kvserve-worker --rank R on host `rankR`, with CURVE keys
    from `kvserve keygen`; it remembers each rank's processes, the current one last."""

    processes: Processes
    network: NetworkNamespaces
    keys_dir: Path
    worker_flags: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=lambda: free_tcp_ports(3))
    workers: dict[int, list[subprocess.Popen]] = field(default_factory=dict)

    @property
    def engine_host(self) -> Host:
        return self.network.hosts["engine"]

    def address(self, port_idx: int) -> str:
        return f"tcp://{self.engine_host.address}:{self.ports[port_idx]}"

    def start(self, engine_flags: list[str], worker_flags: list[str]) -> None:
        self.worker_flags = worker_flags
        keygen = [console_script("kvserve"), "keygen", str(self.keys_dir)]
        subprocess.run(keygen, check=True, capture_output=True, timeout=STARTUP_TIMEOUT_S)
        args = ["-tp", str(TP_SIZE), "--client-address", self.address(0)]
        args += ["--worker-address", self.address(1), "--curve-keys-dir", str(self.keys_dir)]
        argv = [console_script("kvserve-core"), *args, *engine_flags]
        start_in(self.processes, "core", self.engine_host, argv)
        for rank in RANKS:
            self.start_worker(rank)

    def start_worker(self, rank: int) -> subprocess.Popen:
        """A fresh `kvserve-worker --rank R` on host rankR, as process worker-R-N (N: how many
        processes of that rank came before it), rendezvousing at rank 0's address."""
        num_before = len(self.workers.setdefault(rank, []))
        args = ["--rank", str(rank), "-tp", str(TP_SIZE), "--model", MODEL, "--device", "cpu"]
        args += ["--engine-address", self.address(1), "--curve-keys-dir", str(self.keys_dir)]
        args += ["--master-addr", self.network.hosts["rank0"].address]
        args += ["--master-port", str(self.ports[2])]
        args += ["--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES), *self.worker_flags]
        host = self.network.hosts[f"rank{rank}"]
        # The namespace's hostname resolves to nothing, so gloo would bind 127.0.0.1: the worker
        # must pick the interface that routes to the rendezvous host itself (deploy/network.py).
        argv = [console_script("kvserve-worker"), *args]
        proc = start_in(self.processes, f"worker-{rank}-{num_before}", host, argv)
        self.workers[rank].append(proc)
        return proc

    def start_client(self, batch: dict[str, tuple[list[int], int]]) -> subprocess.Popen:
        tmp_path = self.processes.tmp_path
        (tmp_path / "batch.json").write_text(json.dumps(batch))
        code = (
            "import sys; from tests.integration.test_netns import serve_batch; "
            "serve_batch(*sys.argv[1:])"
        )
        files = [str(tmp_path / "batch.json"), str(tmp_path / "results.json")]
        argv = [sys.executable, "-c", code, self.address(0), str(self.keys_dir), *files]
        return start_in(self.processes, "client", self.network.hosts["client"], argv)

    def logs(self) -> str:
        """Every process's log tail, for a failure message."""
        return "\n".join(
            f"--- {name}:\n{self.processes.log(name)[-2000:]}" for name in self.processes.procs
        )

    def stop(self) -> dict[str, int]:
        """SIGTERM the engine; every process's exit code once all have exited."""
        self.processes.procs["core"].send_signal(signal.SIGTERM)
        codes = {}
        for name in self.processes.procs:
            codes[name] = self.processes.wait_exit(name, STOP_TIMEOUT_S)
        return codes


def make_batch(num_requests: int, max_tokens: int) -> dict[str, tuple[list[int], int]]:
    """Prompts longer than a block, sharing a prefix, each with its own start and end."""
    return {
        f"req-{i}": ([3 + i, 40 + i, *range(90, 110), 17 + 2 * i], max_tokens)
        for i in range(num_requests)
    }


def check_results(deployment: Deployment, batch: dict[str, tuple[list[int], int]]) -> None:
    """The client's exit code and every request's tokens and error, against the reference."""
    client, core = deployment.processes.procs["client"], deployment.processes.procs["core"]
    wait_for(
        lambda: client.poll() is not None or core.poll() is not None,
        CLIENT_TIMEOUT_S,
        "the client's exit",
    )
    assert core.poll() is None, f"the engine exited {core.poll()}:\n{deployment.logs()}"
    code = deployment.processes.wait_exit("client", CLIENT_TIMEOUT_S)
    assert code == 0, f"the client exited {code}:\n{deployment.logs()}"
    results = json.loads((deployment.processes.tmp_path / "results.json").read_text())
    assert sorted(results) == sorted(batch)
    for req_id, (prompt, max_tokens) in batch.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        assert results[req_id]["error"] is None, f"{req_id}: {results[req_id]['error']}"
        assert results[req_id]["token_ids"] == reference_generate(MODEL, prompt, params), req_id


@pytest.mark.timeout(180)
def test_ranks_and_a_client_on_other_hosts_serve_the_reference_tokens(
    deployment: Deployment,
) -> None:
    deployment.start([], [])
    batch = make_batch(num_requests=8, max_tokens=16)
    deployment.start_client(batch)
    check_results(deployment, batch)
    codes = deployment.stop()
    assert codes == {"core": 0, "worker-0-0": 0, "worker-1-0": 0, "client": 0}, deployment.logs()


def supervise(deployment: Deployment, client: subprocess.Popen, cut_rank: int) -> None:
    """Stand in for each host's supervisor until the client exits: a rank whose worker exited
    gets a fresh one. The worker of the cut-off rank is killed if it outlives CUT_GRACE_S, and
    its host's link comes back up before its replacement starts, never while it lives."""
    cut_time = time.monotonic()
    is_cut = True
    core = deployment.processes.procs["core"]
    deadline = cut_time + CLIENT_TIMEOUT_S
    while client.poll() is None and core.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the client still waits {CLIENT_TIMEOUT_S} s after the cut")
        for rank in RANKS:
            proc = deployment.workers[rank][-1]
            if is_cut and rank == cut_rank and time.monotonic() - cut_time > CUT_GRACE_S:
                proc.kill()  # no-op once it exited; a stopped process gets reaped just below
            if proc.poll() is None:
                continue
            assert len(deployment.workers[rank]) <= MAX_RESTARTS_PER_RANK, (
                f"rank {rank} was restarted {MAX_RESTARTS_PER_RANK} times:\n{deployment.logs()}"
            )
            if is_cut and rank == cut_rank:
                deployment.network.mend(f"rank{rank}")
                is_cut = False
            deployment.start_worker(rank)
        time.sleep(POLL_S)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cut_rank", [0, 1], ids=["rank0-the-rendezvous-host", "rank1"])
def test_a_rank_cut_off_mid_run_is_replaced_and_every_request_gets_the_reference_tokens(
    deployment: Deployment, cut_rank: int
) -> None:
    processes, network = deployment.processes, deployment.network
    deployment.start(FAST_ENGINE_FLAGS, FAST_WORKER_FLAGS)
    batch = make_batch(num_requests=16, max_tokens=LOAD_MAX_TOKENS)
    client = deployment.start_client(batch)
    wait_for(
        lambda: FIRST_TOKENS in processes.log("client") or client.poll() is not None,
        STARTUP_TIMEOUT_S,
        "the client's first tokens",
    )
    assert FIRST_TOKENS in processes.log("client"), deployment.logs()
    network.cut(f"rank{cut_rank}")
    supervise(deployment, client, cut_rank)
    check_results(deployment, batch)
    codes = deployment.stop()
    assert codes["core"] == 0, deployment.logs()
    assert len(deployment.workers[cut_rank]) > 1, "the cut-off rank was never replaced"
    for rank in RANKS:
        last = f"worker-{rank}-{len(deployment.workers[rank]) - 1}"
        assert codes[last] == 0, f"{last} exited {codes[last]}:\n{deployment.logs()}"
