"""A real engine and real workers serve concurrent requests whose tokens equal the reference
model's: TP=1 and TP=2, prefix caching on and off, a pool small enough to force preemption, the
hybrid sliding-window model, and ranks whose capacities differ.
"""

import json
import pathlib
import re
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import zmq

from engine_client.sync_client import EngineClient
from protocol.codec import kv_event_decoder
from protocol.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    Processes,
    free_tcp_ports,
    launch,
    start_core,
    start_worker,
    stop_launch,
    wait_for,
)
from tests.integration.served_requests import (
    assert_cache_use,
    reference_tokens,
    serve_and_check,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 90.0
EVENT_WAIT_MS = 30_000  # the longest wait for one KV event batch


def serve_same_params_and_check(
    client: EngineClient, model: str, prompts: list[list[int]], params: SamplingParams
) -> None:
    """Submit every prompt at once, all with `params`; each output must equal the reference's."""
    expected = reference_tokens(model)
    serve_and_check(client, prompts, [params] * len(prompts), expected, CLIENT_TIMEOUT_S)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("tp_size", "model", "caching_flag"),
    [
        (1, "checksum", "--enable-prefix-caching"),
        (2, "checksum", "--no-enable-prefix-caching"),
        (2, "tiny-llama", "--enable-prefix-caching"),
        (1, "tiny-llama-hybrid", "--no-enable-prefix-caching"),
        (2, "tiny-llama-hybrid", "--enable-prefix-caching"),
        # its window group's blocks are twice --block-size: two block sizes over one pool
        (2, "tiny-llama-hybrid-2x", "--enable-prefix-caching"),
    ],
)
def test_concurrent_requests_equal_the_reference(
    processes: Processes, addresses: dict, tp_size: int, model: str, caching_flag: str
) -> None:
    launch(processes, addresses, tp_size, model, caching_flag, "--max-model-len", "512")
    num_tokens = 24 if model == "checksum" else 6
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True
        prompts = shared_prefix_prompts(6, 40, 9, seed=tp_size)
        serve_same_params_and_check(client, model, prompts, params)
        stats = client.get_stats()
    assert_cache_use(stats, caching_flag)
    stop_launch(processes)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("tp_size", "model", "num_blocks", "max_model_len", "num_tokens"),
    [
        (1, "checksum", "24", "256", 60),
        (2, "checksum", "24", "256", 60),
        (2, "tiny-llama-hybrid", "12", "64", 20),
        (1, "tiny-llama-hybrid-2x", "12", "64", 20),
    ],
)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes,
    addresses: dict,
    tp_size: int,
    model: str,
    num_blocks: str,
    max_model_len: str,
    num_tokens: int,
) -> None:
    launch(
        processes,
        addresses,
        tp_size,
        model,
        "--num-gpu-blocks-override",
        num_blocks,
        "--max-model-len",
        max_model_len,
        "--check-invariants",  # the engine walks its pool, scheduler and rank maps every step
    )
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    prompts = shared_prefix_prompts(3 if model != "checksum" else 6, 16, 14, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        serve_same_params_and_check(client, model, prompts, params)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with {num_blocks} blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)


@pytest.mark.timeout(90)
def test_ranks_with_different_capacities_agree_on_the_minimum(
    processes: Processes, addresses: dict
) -> None:
    """Separate kvserve-core and kvserve-worker processes over tcp, as ranks on other hosts
    would run; rank 1 has half the memory."""
    client_port, worker_port, master_port = free_tcp_ports(3)
    addresses = {
        "client": f"tcp://127.0.0.1:{client_port}",
        "worker": f"tcp://127.0.0.1:{worker_port}",
        "master_port": str(master_port),
    }
    start_core(processes, addresses, 2, "--max-model-len", "256")
    budgets = {0: 1 << 20, 1: 1 << 19}
    for rank, budget in budgets.items():
        start_worker(processes, addresses, rank, 2, "checksum", kv_cache_memory_bytes=budget)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        prompts = shared_prefix_prompts(3, 20, 5, seed=3)
        serve_same_params_and_check(client, "checksum", prompts, SamplingParams(max_tokens=8))
    held = re.search(r"ranks hold \[(\d+), (\d+)\] blocks; using (\d+)", processes.log("core"))
    assert held, processes.log("core")
    rank0_blocks, rank1_blocks, used = map(int, held.groups())
    assert rank1_blocks < rank0_blocks and used == rank1_blocks
    for rank in budgets:
        assert f"ready: {used} blocks per layer" in processes.log(f"worker-{rank}")
    processes.procs["core"].terminate()
    for name in ("core", "worker-0", "worker-1"):
        assert processes.wait_exit(name, 30) == 0, processes.log(name)[-2000:]


@pytest.mark.timeout(90)
def test_metrics_and_health_endpoints(processes: Processes, addresses: dict) -> None:
    port, master_port = free_tcp_ports(2)  # distinct: the HTTP server and torch's rendezvous
    addresses = dict(addresses, master_port=str(master_port))
    launch(processes, addresses, 1, "checksum", "--metrics-port", str(port))
    base = f"http://127.0.0.1:{port}"
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        prompts = shared_prefix_prompts(4, 32, 3, seed=5)
        serve_same_params_and_check(client, "checksum", prompts, SamplingParams(max_tokens=5))
        assert http_get(f"{base}/health") == (200, "ok\n")
        wait_for(
            lambda: (
                "vllm:prefix_cache_hits_total" in http_get(f"{base}/metrics")[1]
                and _sample(http_get(f"{base}/metrics")[1], "vllm:prefix_cache_hits_total") > 0
            ),
            20,
            "the prefix-cache counters",
        )
    # the loop records a step's latencies just after sending its outputs: wait for the last one
    wait_for(
        lambda: (
            _sample(http_get(f"{base}/metrics")[1], "vllm:inter_token_latency_seconds_count")
            >= 4 * 4
        ),
        20,
        "the last step's inter-token latencies",
    )
    text = http_get(f"{base}/metrics")[1]
    assert _sample(text, "vllm:time_to_first_token_seconds_count") == 4
    assert _sample(text, "vllm:inter_token_latency_seconds_count") == 4 * 4
    wait_for(
        lambda: _sample(http_get(f"{base}/metrics")[1], "vllm:num_requests_running") == 0,
        20,
        "the running gauge to reach 0",
    )
    stop_launch(processes)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.mark.timeout(120)
def test_bench_stats_and_reset_commands_talk_to_a_running_engine(
    processes: Processes, addresses: dict
) -> None:
    launch(processes, addresses, 2, "checksum")
    address = ["--address", addresses["client"]]
    # Two benches at once, as from two shells: request ids are scoped per client and per run.
    for name in ("bench", "bench-2"):
        processes.start(name, "kvserve_main", ["bench", *address, "--num-requests", "16"])
    for name in ("bench", "bench-2"):
        assert processes.wait_exit(name, 90) == 0, processes.log(name)
        bench_log = processes.log(name)
        assert "requests" in bench_log and "prefix-cache hit rate" in bench_log
        assert "duplicate" not in bench_log, bench_log
    processes.start("stats", "kvserve_main", ["stats", *address])
    assert processes.wait_exit("stats", 30) == 0, processes.log("stats")
    assert '"tp_size": 2' in processes.log("stats")
    processes.start("reset", "kvserve_main", ["reset-prefix-cache", *address])
    assert processes.wait_exit("reset", 30) == 0, processes.log("reset")
    assert "prefix cache reset" in processes.log("reset")
    stop_launch(processes)


@pytest.mark.timeout(60)
def test_stats_reset_and_bench_without_an_engine_exit_1_with_the_reason(
    processes: Processes, addresses: dict
) -> None:
    """They used to end in a TimeoutError traceback."""
    for name, method in (("stats", "get_stats"), ("reset-prefix-cache", "reset_prefix_cache")):
        args = [name, "--address", addresses["client"], "--timeout-s", "1"]
        processes.start(name, "kvserve_main", args)
        assert processes.wait_exit(name, 30) == 1, processes.log(name)
        log = processes.log(name)
        assert f"no answer to {method} from the engine" in log and "Traceback" not in log, log
    bench_args = ["bench", "--address", addresses["client"], "--timeout-s", "1"]
    processes.start("bench", "kvserve_main", [*bench_args, "--num-requests", "2"])
    assert processes.wait_exit("bench", 30) == 1, processes.log("bench")
    log = processes.log("bench")
    assert "kvserve bench: 2 requests unfinished" in log and "Traceback" not in log, log


@pytest.mark.timeout(90)
def test_kv_events_are_published_in_order_and_replayed(
    processes: Processes, addresses: dict, ipc_folder: pathlib.Path
) -> None:
    endpoint, replay_endpoint = f"ipc://{ipc_folder}/kv.sock", f"ipc://{ipc_folder}/replay.sock"
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": "kv",
    }
    launch(processes, addresses, 1, "checksum", "--kv-events-config", json.dumps(events_config))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True  # the engine is up, so the subscription reached it
        prompts = shared_prefix_prompts(2, 32, 8, seed=9)
        serve_same_params_and_check(client, "checksum", prompts, SamplingParams(max_tokens=4))
        assert client.reset_prefix_cache() is True
    live = receive_batches(sub, until=lambda events: isinstance(events[-1], AllBlocksCleared))
    seqs = [seq for seq, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gaps in {seqs}"
    events = [event for _, batch in live for event in batch.events]
    assert any(isinstance(event, BlockStored) for event in events)
    assert isinstance(events[-1], AllBlocksCleared)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert replay.poll(EVENT_WAIT_MS), "no replay answer"
        _, topic, seq, payload = replay.recv_multipart()  # vLLM's replay frames
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        assert topic == b"kv"
        assert kv_event_decoder().decode(payload).events, "an empty batch was published"
        replayed.append(int.from_bytes(seq, "big"))
    assert replayed == list(range(len(replayed))) and replayed[-1] >= seqs[-1]
    ctx.destroy(linger=0)
    stop_launch(processes)
    leftovers = sorted(path.name for path in ipc_folder.glob("*.sock"))
    assert leftovers == [], f"the engine left its ipc socket files behind: {leftovers}"


def receive_batches(
    sub: zmq.Socket, until: Callable[[list], bool]
) -> list[tuple[int, KVEventBatch]]:
    decoder = kv_event_decoder()
    batches: list[tuple[int, KVEventBatch]] = []
    events: list = []
    while not events or not until(events):
        assert sub.poll(EVENT_WAIT_MS), f"no KV event batch after {len(batches)}"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        events.extend(batches[-1][1].events)
    return batches
