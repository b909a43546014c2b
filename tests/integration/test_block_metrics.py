"""With --kv-cache-metrics, a real engine exports vLLM's KV-cache block histograms on /metrics:
a small pool that must evict cached blocks yields lifetimes, idle times and reuse gaps."""

import random
import re
import urllib.request

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, launch, stop_launch, wait_for

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 60.0
NUM_BLOCKS = 16  # 15 usable blocks of 16 tokens; each request below holds 4
BLOCK_HISTOGRAMS = (
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
)


def _serve(client: EngineClient, prompts: dict[str, list[int]]) -> None:
    params = SamplingParams(max_tokens=4)
    for req_id, prompt in prompts.items():
        client.add_request(make_request(req_id, prompt, params))
    results = client.run_until_finished(list(prompts), CLIENT_TIMEOUT_S)
    for req_id, result in results.items():
        assert result.error is None, f"{req_id} failed: {result.error}"


def _count(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name)}_count (\S+)$", text, re.MULTILINE)
    assert match, f"{name}_count missing from /metrics"
    return float(match.group(1))


@pytest.mark.timeout(120)
def test_block_histograms_count_evictions_and_reuse(processes: Processes, addresses: dict) -> None:
    port, master_port = free_tcp_ports(2)  # distinct: the HTTP server and torch's rendezvous
    addresses = dict(addresses, master_port=str(master_port))
    launch(
        processes,
        addresses,
        1,
        "checksum",
        "--metrics-port",
        str(port),
        "--kv-cache-metrics",
        "--kv-cache-metrics-sample",
        "1.0",
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--max-model-len",
        "128",
    )
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        _serve(client, {"shared": shared})
        _serve(client, {"shared-again": shared})  # hits the first one's blocks: a reuse gap
        # 8 distinct prompts need 32 blocks of the 15: cached blocks are evicted for them
        _serve(client, {f"other-{i}": [rng.randrange(3, 500) for _ in range(48)] for i in range(8)})
    url = f"http://127.0.0.1:{port}/metrics"
    for name in BLOCK_HISTOGRAMS:  # the loop drains the samples every half second
        wait_for(lambda name=name: _count(url, name) > 0, 20, f"observations of {name}")
    stop_launch(processes)
