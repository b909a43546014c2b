"""The front end's KV-event index against real engines: after a workload that evicts, a reset, a
rank recovery, a restarted front end, and an engine that stops and comes back, its index of each
engine equals that engine's own map (get_cached_block_hashes); a batch dropped on purpose heals
through replay; predictions of the kv policy match the hits the engines report; an engine that
hashes differently is refused; CURVE streams are followed with the client keys.
"""

import asyncio
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from api_server.routing.engine_record import StreamSource, engine_records
from api_server.routing.kv_event_subscriber import KVEventSubscriber
from deploy.keys import keygen, load_curve_keys
from engine_client.async_client import AsyncEngineClient
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    Processes,
    free_tcp_ports,
    launch,
    stop_launch,
    stop_process,
    wait_for,
    wait_while_running,
)

pytestmark = pytest.mark.integration

MODEL = "checksum"
SLOW = "fixed-time"  # checksum's tokens, each forward lasting --model-step-ms
ENGINE_FLAGS = ("--num-gpu-blocks-override", "24", "--max-model-len", "256")
STARTUP_TIMEOUT_S = 120.0
SYNC_TIMEOUT_S = 20.0  # the index must catch up with an idle engine's map within this
SILENT_LIMIT_S = 2.0
HTTP_TIMEOUT_S = 60.0


def events_flags(ports: tuple[int, int]) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{ports[0]}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}",
        "topic": "kv",
    }
    return ["--kv-events-config", json.dumps(config)]


def launch_engine(
    processes: Processes, folder: Path, name: str, *extra: str, model: str = MODEL
) -> str:
    client = f"ipc://{folder}/client-{name}.sock"
    args = ["launch", "-tp", "1", "--model", model, "--device", "cpu", "--client-address", client]
    args += ["--worker-address", f"ipc://{folder}/worker-{name}.sock", "--log-level", "INFO"]
    args += ["--master-port", str(free_tcp_ports(1)[0]), "--kv-cache-memory-bytes", "4000000"]
    processes.start(f"launch-{name}", "kvserve_main", [*args, *ENGINE_FLAGS, *extra])
    return client


def start_front_end(
    processes: Processes, name: str, engines: list[str], port: int, *extra: str, model: str = MODEL
) -> str:
    args = ["serve", "--model", model, "--port", str(port), "--log-level", "INFO", *extra]
    args += ["--router-policy", "kv", "--router-silent-limit-s", str(SILENT_LIMIT_S)]
    for address in engines:
        args += ["--engine-address", address]
    processes.start(name, "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"

    def following() -> bool:
        try:
            stats = httpx.get(f"{url}/router", timeout=2).json()
        except (httpx.TransportError, json.JSONDecodeError):
            return False
        engines_stats = stats.get("engines", [])
        return all(
            e["is_following_kv_events"] and not e["is_kv_events_silent"] for e in engines_stats
        )

    what = f"{name} following every engine's KV events"
    wait_while_running(processes, name, following, STARTUP_TIMEOUT_S, what)
    return url


def engine_keys(address: str) -> set[str]:
    with EngineClient(address, timeout_s=10) as client:
        counts = client.call_utility("get_cached_block_hashes")
    assert isinstance(counts, dict), counts
    return set(counts)


def router_stats(url: str) -> dict:
    return httpx.get(f"{url}/router", params={"include_keys": "true"}, timeout=5).json()


def assert_index_matches(url: str, addresses: list[str], phase: str) -> dict:
    """The engines are idle: each one's map is final, and the front end's index of it must
    reach exactly that set of keys."""
    expected = [engine_keys(address) for address in addresses]

    def matched() -> dict | None:
        stats = router_stats(url)
        found = [set(engine["index_keys"]) for engine in stats["engines"]]
        return stats if found == expected else None

    try:
        return wait_for(matched, SYNC_TIMEOUT_S, f"the index matching the engines {phase}")  # type: ignore[return-value]
    except TimeoutError:
        found = [set(engine["index_keys"]) for engine in router_stats(url)["engines"]]
        sizes = [(len(e), len(f), len(e ^ f)) for e, f in zip(expected, found, strict=True)]
        raise AssertionError(f"{phase}: (engine, index, differing) keys {sizes}") from None


def conversation_prompts(seed: int, num_prompts: int) -> list[list[int]]:
    """Prompts on four 40-token system prompts, each with its own 12..30-token question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    return [
        systems[i % 4] + [rng.randrange(3, 250) for _ in range(rng.randrange(12, 31))]
        for i in range(num_prompts)
    ]


def complete(url: str, prompt: list[int], model: str = MODEL) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]


def drive(url: str, prompts: list[list[int]]) -> None:
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda prompt: complete(url, prompt), prompts))


@pytest.mark.timeout(420)
def test_the_index_equals_the_engines_maps_through_eviction_reset_restart_and_churn(
    processes: Processes, ipc_folder: Path
) -> None:
    ports = free_tcp_ports(5)
    engines = [
        launch_engine(
            processes,
            ipc_folder,
            "a",
            *events_flags((ports[0], ports[1])),
            *("--max-worker-restarts", "1"),
        ),
        launch_engine(processes, ipc_folder, "b", *events_flags((ports[2], ports[3]))),
    ]
    url = start_front_end(processes, "api", engines, ports[4])
    drive(url, conversation_prompts(seed=1, num_prompts=24))  # 24 blocks each: evictions
    stats = assert_index_matches(url, engines, "after a workload that evicts")
    assert all(engine["decisions"] > 0 for engine in stats["engines"]), stats
    assert all(engine["index_blocks"] > 0 for engine in stats["engines"]), stats

    # One request at a time on a synced index: every predicted hit is the engine's own.
    before = router_stats(url)["engines"]
    for prompt in conversation_prompts(seed=2, num_prompts=6):
        complete(url, prompt)
        assert_index_matches(url, engines, "between sequential requests")
    after = router_stats(url)["engines"]
    predicted = sum(
        a["predicted_hit_tokens"] - b["predicted_hit_tokens"]
        for a, b in zip(after, before, strict=True)
    )
    actual = sum(
        a["actual_hit_tokens"] - b["actual_hit_tokens"] for a, b in zip(after, before, strict=True)
    )
    assert predicted == actual > 0, (predicted, actual)

    with EngineClient(engines[1], timeout_s=10) as client:
        assert client.reset_prefix_cache() is True
    stats = assert_index_matches(url, engines, "after engine b's reset")
    assert stats["engines"][1]["index_blocks"] == 0 and stats["engines"][0]["index_blocks"] > 0

    # A rank of engine a dies and its generation is replaced (whatever the engine then does with
    # its cache, the index must follow it).
    os.kill(int(re.findall(r"rank 0 joined: pid (\d+)", processes.log("launch-a"))[-1]), 9)
    wait_for(
        lambda: (
            "worker generation 1 lost" in processes.log("launch-a")
            and re.search(r"worker generation 2 ready", processes.log("launch-a"))
        ),
        STARTUP_TIMEOUT_S,
        "engine a's new worker generation",
    )
    drive(url, conversation_prompts(seed=8, num_prompts=8))
    assert_index_matches(url, engines, "after engine a's rank recovery")

    stop_process(processes, "api")  # a new front end rebuilds the index by replay on connect
    url = start_front_end(processes, "api-again", engines, ports[4])
    assert_index_matches(url, engines, "after the front end restarted")
    drive(url, conversation_prompts(seed=3, num_prompts=8))
    assert_index_matches(url, engines, "after the restarted front end served")

    stop_process(processes, "launch-b")  # engine b leaves: its stream falls silent

    def b_is_silent() -> bool:
        engine_b = router_stats(url)["engines"][1]
        return engine_b["is_kv_events_silent"] and not engine_b["is_routable"]

    wait_for(b_is_silent, SILENT_LIMIT_S + 20, "engine b's KV events judged silent")
    drive(url, conversation_prompts(seed=4, num_prompts=4))  # served by engine a alone
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert 'kvserve:router_kv_events_silent{engine="1"} 1.0' in metrics
    assert 'kvserve:router_kv_events_silences_total{engine="1"} 1.0' in metrics
    assert "routed by load alone" in processes.log("api-again")

    # Engine b comes back on the same addresses: its publisher counts from 0 again.
    launch_engine(processes, ipc_folder, "b", *events_flags((ports[2], ports[3])))

    def b_is_back() -> bool:
        engine_b = router_stats(url)["engines"][1]
        return engine_b["is_routable"] and not engine_b["is_kv_events_silent"]

    wait_for(b_is_back, STARTUP_TIMEOUT_S, "engine b routed to again")
    drive(url, conversation_prompts(seed=10, num_prompts=12))
    stats = assert_index_matches(url, engines, "after engine b restarted")
    assert stats["engines"][1]["restarts"] == 1 and stats["engines"][1]["index_blocks"] > 0
    stop_process(processes, "api-again")
    stop_process(processes, "launch-a")
    stop_process(processes, "launch-b")


@pytest.mark.timeout(240)
def test_the_kv_policy_weighs_work_another_client_sent_the_engine_directly(
    processes: Processes, ipc_folder: Path
) -> None:
    """A client talking to engine a directly keeps two requests decoding there: the front end
    learns it from engine a's load report, and sends a request whose prefix a holds to engine b
    while they run (a decode weighs 100 prompt tokens here), then one whose prefix a holds
    longer to engine a once they ended. On the front end's own count, a would have won both."""
    slow = ("--model-step-ms", "100")  # the direct requests decode for about 10 s
    ports = free_tcp_ports(5)
    engines = [
        launch_engine(processes, ipc_folder, name, *events_flags(pair), *slow, model=SLOW)
        for name, pair in (("a", (ports[0], ports[1])), ("b", (ports[2], ports[3])))
    ]
    weight = ("--router-decode-weight", "100")
    url = start_front_end(processes, "api", engines, ports[4], *weight, model=SLOW)
    prompt = [random.Random(11).randrange(3, 250) for _ in range(48)]  # 3 blocks of 16

    def serve_directly() -> None:
        async def run() -> None:
            client = AsyncEngineClient(engines[0], timeout_s=HTTP_TIMEOUT_S)
            try:
                params = SamplingParams(max_tokens=100, ignore_eos=True)
                requests = [make_request(f"direct-{idx}", prompt, params) for idx in range(2)]

                async def one(request) -> None:  # type: ignore[no-untyped-def]
                    async for output in client.generate(request):
                        assert output.error is None, output.error

                await asyncio.gather(*(one(request) for request in requests))
            finally:
                await client.close()

        asyncio.run(run())

    def others(want: list[int]) -> dict | None:
        stats = router_stats(url)
        found = [engine["other_running_decodes"] for engine in stats["engines"]]
        return stats if found == want else None

    with ThreadPoolExecutor(1) as pool:
        direct = pool.submit(serve_directly)
        stats = wait_for(lambda: others([2, 0]), SYNC_TIMEOUT_S, "engine a reporting 2 decodes")
        assert stats["engines"][0]["index_blocks"] >= 3, stats  # a holds the prompt's blocks
        assert stats["engines"][0]["decisions"] == 0, stats
        complete(url, prompt[:32] + [7] * 24, model=SLOW)  # a holds its first 2 blocks
        decisions = [engine["decisions"] for engine in router_stats(url)["engines"]]
        assert decisions == [0, 1], decisions  # a's cached prefix lost to its other client
        direct.result(timeout=HTTP_TIMEOUT_S)
    wait_for(lambda: others([0, 0]), SYNC_TIMEOUT_S, "engine a reporting its decodes ended")
    complete(url, prompt + [9] * 8, model=SLOW)  # a holds 3 blocks of it, b 2
    decisions = [engine["decisions"] for engine in router_stats(url)["engines"]]
    assert decisions == [1, 1], decisions  # idle again, a's cached prefix wins
    stop_process(processes, "api")
    stop_process(processes, "launch-a")
    stop_process(processes, "launch-b")


def test_a_dropped_batch_heals_through_replay(processes: Processes, addresses: dict) -> None:
    """A subscriber told to drop two live batches finds the gap (or, at the stream's tail, its
    quiet-stream replay does) and asks the engine's replay for what it missed."""
    ports = free_tcp_ports(2)
    launch(processes, addresses, 1, MODEL, *ENGINE_FLAGS, *events_flags((ports[0], ports[1])))
    source = StreamSource(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", "kv")
    asyncio.run(_drop_and_heal(addresses["client"], source))
    stop_launch(processes)


class DroppingSubscriber(KVEventSubscriber):
    """A subscriber whose live socket loses the next `num_to_drop` batches, as a slow joiner or a
    full high-water mark loses them: the frames never reach the subscriber's own handling."""

    num_to_drop = 0

    def _on_live(self, engine_idx: int, frames: list[bytes]) -> bool:
        if self.num_to_drop > 0:
            self.num_to_drop -= 1
            return False
        return super()._on_live(engine_idx, frames)


async def _drop_and_heal(address: str, source: StreamSource) -> None:
    records = engine_records([address])
    subscriber = DroppingSubscriber(records, silent_limit_s=SILENT_LIMIT_S)
    stream = records[0].kv_events
    client = AsyncEngineClient(address, timeout_s=HTTP_TIMEOUT_S)
    try:
        subscriber.follow(0, source)
        await _wait_async(lambda: not stream.is_silent, "the stream answering")
        await _serve(client, conversation_prompts(seed=5, num_prompts=6), "warm")
        await _wait_synced(subscriber, client, "before the drop")
        subscriber.num_to_drop = 2
        num_replays = stream.num_replays
        await _serve(client, conversation_prompts(seed=6, num_prompts=10), "dropped")
        assert subscriber.num_to_drop == 0, "fewer than two batches came"
        await _wait_synced(subscriber, client, "after two dropped batches")
        assert stream.num_replays > num_replays
        assert stream.num_unknown_removals == 0
    finally:
        await client.close()
        await subscriber.close()


async def _serve(client: AsyncEngineClient, prompts: list[list[int]], wave: str) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    async def one(idx: int, prompt: list[int]) -> None:
        async for output in client.generate(make_request(f"{wave}-{idx}", prompt, params)):
            assert output.error is None, output.error

    await asyncio.gather(*(one(idx, prompt) for idx, prompt in enumerate(prompts)))


async def _wait_async(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + SYNC_TIMEOUT_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{what}: not within {SYNC_TIMEOUT_S} s")
        await asyncio.sleep(0.05)


async def _wait_synced(
    subscriber: KVEventSubscriber, client: AsyncEngineClient, phase: str
) -> None:
    counts = await client.call_utility("get_cached_block_hashes")
    assert isinstance(counts, dict), counts
    expected = {bytes.fromhex(key) for key in counts}
    await _wait_async(lambda: subscriber.index.engine_keys(0) == expected, phase)


@pytest.mark.timeout(240)
def test_a_curve_engines_events_are_followed_with_the_client_keys(
    processes: Processes, tmp_path: Path
) -> None:
    """`kvserve serve --curve-keys-dir` launches a CURVE engine publishing KV events on TCP; the
    front end subscribes and replays as a CURVE client, and its index matches the engine's."""
    keys_dir = tmp_path / "keys"
    keygen(keys_dir)
    http_port, client_port, worker_port, master_port, pub_port, replay_port = free_tcp_ports(6)
    client_address = f"tcp://127.0.0.1:{client_port}"
    args = ["serve", "--model", MODEL, "--port", str(http_port), "--log-level", "INFO"]
    args += ["--router-policy", "kv", "--curve-keys-dir", str(keys_dir), "--device", "cpu"]
    args += ["--client-address", client_address, "--worker-address"]
    args += [f"tcp://127.0.0.1:{worker_port}", "--master-port", str(master_port)]
    args += ["--kv-cache-memory-bytes", "4000000", *ENGINE_FLAGS]
    processes.start("api", "kvserve_main", [*args, *events_flags((pub_port, replay_port))])
    url = f"http://127.0.0.1:{http_port}"

    def following() -> bool:
        try:
            engine = httpx.get(f"{url}/router", timeout=2).json()["engines"][0]
        except (httpx.TransportError, json.JSONDecodeError, KeyError):
            return False
        return engine["is_following_kv_events"] and not engine["is_kv_events_silent"]

    what = "the front end following the CURVE engine's events"
    wait_while_running(processes, "api", following, STARTUP_TIMEOUT_S, what)
    drive(url, conversation_prompts(seed=7, num_prompts=6))
    curve = load_curve_keys(keys_dir, "client")
    with EngineClient(client_address, timeout_s=10, curve=curve) as client:
        counts = client.call_utility("get_cached_block_hashes")
    assert isinstance(counts, dict) and counts
    wait_for(
        lambda: set(router_stats(url)["engines"][0]["index_keys"]) == set(counts),
        SYNC_TIMEOUT_S,
        "the index matching the CURVE engine's map",
    )
    stop_process(processes, "api")


@pytest.mark.timeout(240)
def test_an_engine_that_hashes_differently_is_named_and_never_routed_to(
    processes: Processes, ipc_folder: Path
) -> None:
    ports = free_tcp_ports(5)
    engines = [
        launch_engine(processes, ipc_folder, "a", *events_flags((ports[0], ports[1]))),
        launch_engine(
            processes, ipc_folder, "b", *events_flags((ports[2], ports[3])), "--hash-seed", "other"
        ),
    ]
    args = ["serve", "--model", MODEL, "--port", str(ports[4]), "--log-level", "INFO"]
    for address in engines:
        args += ["--engine-address", address]
    processes.start("api", "kvserve_main", args)
    url = f"http://127.0.0.1:{ports[4]}"

    def b_refused() -> dict | None:
        try:
            stats = httpx.get(f"{url}/router", timeout=2).json()
        except (httpx.TransportError, json.JSONDecodeError):
            return None
        a, b = stats["engines"]
        return stats if a["is_routable"] and b["hash_mismatch"] is not None else None

    what = "engine b refused for its hash seed"
    stats = wait_while_running(processes, "api", b_refused, STARTUP_TIMEOUT_S, what)
    assert stats["router_policy"] == "kv"  # the default
    assert stats["engines"][1]["hash_mismatch"] == "hash_seed: 'kvserve' != 'other'"
    assert not stats["engines"][1]["is_routable"]
    assert "hashes blocks unlike the first engine (hash_seed: 'kvserve' != 'other')" in (
        processes.log("api")
    )
    drive(url, conversation_prompts(seed=9, num_prompts=4))
    decisions = [engine["decisions"] for engine in router_stats(url)["engines"]]
    assert decisions == [4, 0], decisions
    processes.start("stats", "kvserve_main", ["stats", "--url", url])
    assert processes.wait_exit("stats", 30) == 0, processes.log("stats")
    num_blocks = router_stats(url)["engines"][0]["index_blocks"]
    assert num_blocks > 0
    assert f"engine 0 {engines[0]}: {num_blocks} blocks indexed, 4 requests routed" in (
        processes.log("stats")
    )
    stop_process(processes, "api")
    stop_process(processes, "launch-a")
    stop_process(processes, "launch-b")
