"""Disaggregated prefill and decode with real processes: a prefill engine and a decode engine
(`kvserve launch --kv-role ...`) behind one front end (`kvserve serve --engine-address` twice).

Tokens equal the unpaged reference (one engine's) for greedy and seeded requests sharing a
prefix; the front end's KV-event index equals each engine's map after the transfers; a forged
handle is refused and counted and its request still gets exact tokens; a handle nobody pulls is
freed at the deadline; a prefill engine killed while requests are in flight costs them their
transfer only. After each phase both engines' KV usage is back to idle.
"""

import importlib.util
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.kv_transfer import KVTransferHandle
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    Processes,
    free_tcp_ports,
    stop_process,
    wait_for,
    wait_while_running,
)
from tests.integration.served_requests import shared_prefix_prompts
from tests.integration.test_kv_routing import assert_index_matches, events_flags
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
ENGINE_FLAGS = ("--kv-cache-memory-bytes", "16000000", "--max-model-len", "512")
TRANSFER_TIMEOUT_S = 4.0  # the prefill engine's --kv-transfer-timeout-s
STARTUP_TIMEOUT_S = 180.0
HTTP_TIMEOUT_S = 90.0
IDLE_TIMEOUT_S = 20.0


def launch_engine(
    processes: Processes, folder: Path, name: str, *extra: str, tp: int = 1, model: str = MODEL
) -> str:
    """`kvserve launch` in a session of its own (so that a test can kill the whole of it)."""
    client = f"ipc://{folder}/client-{name}.sock"
    args = ["launch", "-tp", str(tp), "--model", model, "--device", "cpu"]
    args += ["--client-address", client]
    args += ["--worker-address", f"ipc://{folder}/worker-{name}.sock", "--log-level", "INFO"]
    args += ["--master-port", str(free_tcp_ports(1)[0]), *ENGINE_FLAGS, *extra]
    if "prefill" in extra:  # its ranks' transfer sockets beside the test's other sockets
        args += ["--kv-transfer-address", f"ipc://{folder}"]
    processes.start(f"launch-{name}", "kvserve_main", args, new_session=True)
    return client


def start_front_end(
    processes: Processes, engines: list[str], port: int, roles: list[str], model: str = MODEL
) -> str:
    args = ["serve", "--model", model, "--port", str(port), "--log-level", "INFO"]
    args += ["--router-policy", "kv"]
    for address in engines:
        args += ["--engine-address", address]
    processes.start("api", "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"

    def paired() -> bool:
        try:
            engines_stats = httpx.get(f"{url}/router", timeout=2).json()["engines"]
        except (httpx.TransportError, ValueError, KeyError):
            return False
        announced = [engine["kv_role"] for engine in engines_stats]
        return announced == roles and all(
            engine["is_routable"] and engine["is_following_kv_events"] for engine in engines_stats
        )

    wait_while_running(processes, "api", paired, STARTUP_TIMEOUT_S, "the front end pairing P/D")
    return url


def engine_stats(address: str) -> dict:
    with EngineClient(address, timeout_s=10) as client:
        return client.get_stats()  # type: ignore[return-value]


def wait_idle(address: str, what: str) -> dict:
    def idle() -> dict | None:
        stats = engine_stats(address)
        is_idle = stats["kv_cache_usage"] == 0.0 and stats["num_running_reqs"] == 0
        return stats if is_idle and not stats.get("kv_transfer_held_blocks") else None

    return wait_for(idle, IDLE_TIMEOUT_S, f"{what} back to idle")  # type: ignore[return-value]


def params_of(idx: int) -> SamplingParams:
    if idx % 3 == 2:
        return SamplingParams(max_tokens=10, temperature=0.8, seed=idx, ignore_eos=True)
    return SamplingParams(max_tokens=10, ignore_eos=True)


def complete(url: str, idx: int, prompt: list[int], model: str = MODEL) -> str:
    params = params_of(idx)
    body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "ignore_eos": True}
    body |= {"temperature": params.temperature}
    if params.seed is not None:
        body["seed"] = params.seed
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def serve_and_check(url: str, prompts: list[list[int]], first_idx: int, model: str = MODEL) -> None:
    """Every prompt at once through the front end; each text must be the reference's."""
    tokenizer = ByteTokenizer()
    indexed = list(enumerate(prompts, start=first_idx))
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda item: complete(url, *item, model=model), indexed))
    for (idx, prompt), text in zip(indexed, texts, strict=True):
        expected = reference_generate(model, prompt, params_of(idx), max_model_len=512)
        assert text == tokenizer.decode(expected), f"request {idx}"


def prefill_only(address: str, req_id: str, prompt: list[int]) -> KVTransferHandle:
    """A do_remote_decode request sent straight to the prefill engine: its handle."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    request = msgspec.structs.replace(make_request(req_id, prompt, params), do_remote_decode=True)
    with EngineClient(address, timeout_s=30) as client:
        client.add_request(request)
        for _ in range(100):
            for output in client.get_outputs(timeout_s=30):
                if output.finish_reason is not None:
                    assert output.kv_transfer_handle is not None, output
                    return output.kv_transfer_handle
    raise AssertionError("the prefill engine never finished")


def decode_with(address: str, req_id: str, prompt: list[int], handle: KVTransferHandle) -> list:
    params = params_of(0)
    request = msgspec.structs.replace(
        make_request(req_id, prompt, params), kv_transfer_handle=handle
    )
    with EngineClient(address, timeout_s=60) as client:
        client.add_request(request)
        return client.run_until_finished([req_id], 60)[req_id].token_ids


@pytest.mark.timeout(600)
def test_one_prefill_one_decode_serve_exact_tokens_through_faults(
    processes: Processes, ipc_folder: Path
) -> None:
    ports = free_tcp_ports(5)
    prefill = launch_engine(
        processes,
        ipc_folder,
        "p",
        *("--kv-role", "prefill", "--kv-transfer-timeout-s", str(TRANSFER_TIMEOUT_S)),
        *events_flags((ports[0], ports[1])),
    )
    decode = launch_engine(
        processes, ipc_folder, "d", "--kv-role", "decode", *events_flags((ports[2], ports[3]))
    )
    url = start_front_end(processes, [prefill, decode], ports[4], ["prefill", "decode"])

    # 1. Exact tokens, prefix hits on the prefill side, pulls on the decode side.
    prompts = shared_prefix_prompts(6, prefix_len=40, tail_len=9, seed=3)
    serve_and_check(url, prompts, first_idx=0)
    prefill_stats = wait_idle(prefill, "the prefill engine")
    decode_stats = wait_idle(decode, "the decode engine")
    assert prefill_stats["kv_role"] == "prefill" and decode_stats["kv_role"] == "decode"
    assert prefill_stats["kv_transfer_handles"] == 6, prefill_stats
    assert prefill_stats["kv_transfer_released"] == 6, prefill_stats
    assert decode_stats["kv_transfer_pulls"] == 6 and decode_stats["kv_transfer_failed_pulls"] == 0
    assert decode_stats["kv_transfer_pulled_bytes"] > 0, decode_stats
    assert_index_matches(url, [prefill, decode], "after transfers")  # KV events stay exact
    router = httpx.get(f"{url}/router", timeout=5).json()
    assert router["pd_requests"] == 6 and router["pd_recomputed_requests"] == 0, router
    # --kv-transport auto: through NIXL where it is installed (the 2P1D test runs builtin)
    is_nixl_read = "KV pages move through NIXL" in processes.log("launch-d")
    assert is_nixl_read == (importlib.util.find_spec("nixl") is not None)

    # 2. A forged handle reads nothing and its request is still exact; nobody pulls the real one,
    # and its blocks are freed at the deadline.
    prompt = shared_prefix_prompts(1, prefix_len=50, tail_len=7, seed=11)[0]
    handle = prefill_only(prefill, "forge-me", prompt)
    forged = msgspec.structs.replace(handle, secret="f" * 32)
    tokens = decode_with(decode, "forged", prompt, forged)
    assert tokens == reference_generate(MODEL, prompt, params_of(0), max_model_len=512)
    assert engine_stats(decode)["kv_transfer_failed_pulls"] == 1
    assert "refused a KV pull: no pinned transfer" in processes.log("launch-p")
    assert engine_stats(prefill)["kv_transfer_held_blocks"] > 0
    stats = wait_idle(prefill, "the prefill engine, once the unpulled handle expired")
    assert stats["kv_transfer_expired"] == 1, stats
    assert stats["kv_transfer_refused_pulls"] == 1, stats  # the forged one, counted there too
    wait_idle(decode, "the decode engine")

    # 3. The prefill engine is killed (its whole session) while requests are in flight: every
    # request is still answered exactly, by the decode engine computing what it lacks.
    prompts = shared_prefix_prompts(8, prefix_len=30, tail_len=20, seed=5)
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(serve_and_check, url, prompts, 10)
        wait_for(
            lambda: engine_stats(prefill)["kv_transfer_handles"] > 7,
            HTTP_TIMEOUT_S,
            "the prefill engine serving the third batch",
        )
        os.killpg(processes.procs["launch-p"].pid, signal.SIGKILL)
        served.result(timeout=HTTP_TIMEOUT_S * 2)
    processes.procs["launch-p"].wait(10)
    serve_and_check(url, prompts[:2], first_idx=30)  # the decode engine alone now
    wait_idle(decode, "the decode engine after the prefill engine died")
    stop_process(processes, "api")
    stop_process(processes, "launch-d")


@pytest.mark.timeout(600)
def test_two_prefill_engines_and_one_decode_engine_at_tp_2(
    processes: Processes, ipc_folder: Path
) -> None:
    """2P1D, every engine with two ranks: each decode rank pulls its shard from the same rank
    of whichever prefill engine held the request (the built-in transport, NIXL or not); the
    tokens are one engine's. A host tier
    under one prefill engine and under the small decode engine (which offloads pulled blocks),
    and every engine walking its invariants after each step."""
    model = "checksum"
    ports = free_tcp_ports(7)
    tier = ("--kv-offload-host-bytes", "4000000")
    extra = {
        "p0": ("--kv-role", "prefill", "--kv-transport", "builtin", *tier),
        "p1": ("--kv-role", "prefill", "--kv-transport", "builtin"),
        "d": (
            "--kv-role",
            "decode",
            "--kv-transport",
            "builtin",
            "--num-gpu-blocks-override",
            "40",
            *tier,
        ),
    }
    engines = [
        launch_engine(
            processes,
            ipc_folder,
            name,
            *flags,
            "--check-invariants",
            *events_flags((ports[2 * idx], ports[2 * idx + 1])),
            tp=2,
            model=model,
        )
        for idx, (name, flags) in enumerate(extra.items())
    ]
    url = start_front_end(processes, engines, ports[6], ["prefill", "prefill", "decode"], model)
    prompts = shared_prefix_prompts(4, prefix_len=40, tail_len=9, seed=7)
    prompts += shared_prefix_prompts(4, prefix_len=36, tail_len=5, seed=8)
    prompts += shared_prefix_prompts(6, prefix_len=20, tail_len=100, seed=9)
    serve_and_check(url, prompts, first_idx=0, model=model)
    prefill_stats = [wait_idle(address, "a prefill engine") for address in engines[:2]]
    decode_stats = wait_idle(engines[2], "the decode engine")
    assert sum(stats["kv_transfer_handles"] for stats in prefill_stats) == len(prompts)
    # a request whose pullable blocks the decode engine already caches (a shared prefix pulled
    # for an earlier one) pulls nothing
    num_pulled, num_skipped = (
        decode_stats["kv_transfer_pulls"],
        decode_stats["kv_transfer_skipped_pulls"],
    )
    assert num_pulled >= 2 and num_pulled + num_skipped == len(prompts), decode_stats
    assert decode_stats["kv_transfer_failed_pulls"] == 0, decode_stats
    assert decode_stats["prefix_cache_blocks_to_host"] > 0, "the decode engine should offload"
    # (the index also holds the decode engine's host-tier copies, which its device map lacks:
    # the first test compares the index with tierless engines)
    stop_process(processes, "api")
    for name in ("p0", "p1", "d"):
        stop_process(processes, f"launch-{name}")


@pytest.mark.timeout(600)
def test_a_prefill_engine_at_tp_1_and_a_decode_engine_at_tp_2(
    processes: Processes, ipc_folder: Path
) -> None:
    """A TP-mismatched pair: each decode rank pulls its half of the KV heads from the one
    prefill rank; the tokens are one engine's, every pull completes, both end idle."""
    model = "checksum"
    ports = free_tcp_ports(5)
    prefill = launch_engine(
        processes,
        ipc_folder,
        "p",
        *("--kv-role", "prefill", "--check-invariants"),
        *events_flags((ports[0], ports[1])),
        tp=1,
        model=model,
    )
    decode = launch_engine(
        processes,
        ipc_folder,
        "d",
        *("--kv-role", "decode", "--check-invariants"),
        *events_flags((ports[2], ports[3])),
        tp=2,
        model=model,
    )
    url = start_front_end(processes, [prefill, decode], ports[4], ["prefill", "decode"], model)
    prompts = shared_prefix_prompts(5, prefix_len=40, tail_len=9, seed=13)
    serve_and_check(url, prompts, first_idx=0, model=model)
    prefill_stats = wait_idle(prefill, "the prefill engine")
    decode_stats = wait_idle(decode, "the decode engine")
    assert prefill_stats["kv_transfer_released"] == len(prompts), prefill_stats
    assert decode_stats["kv_transfer_pulls"] >= 1, decode_stats
    assert decode_stats["kv_transfer_failed_pulls"] == 0, decode_stats
    num_pulled = decode_stats["kv_transfer_pulls"] + decode_stats["kv_transfer_skipped_pulls"]
    assert num_pulled == len(prompts), decode_stats
    router = httpx.get(f"{url}/router", timeout=5).json()
    assert router["pd_recomputed_requests"] == 0, router
    stop_process(processes, "api")
    stop_process(processes, "launch-p")
    stop_process(processes, "launch-d")


@pytest.mark.timeout(600)
def test_a_hybrid_model_moves_every_groups_blocks(processes: Processes, ipc_folder: Path) -> None:
    """tiny-llama-hybrid (a full-attention and a sliding-window group of 48 tokens over one
    pool), prompts long enough that the window group's hit needs only its last three blocks:
    the tokens are one engine's, every pull completes, and the front end's KV-event index
    equals each engine's cached blocks after the transfers."""
    model = "tiny-llama-hybrid"
    ports = free_tcp_ports(5)
    prefill = launch_engine(
        processes,
        ipc_folder,
        "p",
        *("--kv-role", "prefill", "--check-invariants"),
        *events_flags((ports[0], ports[1])),
        model=model,
    )
    decode = launch_engine(
        processes,
        ipc_folder,
        "d",
        *("--kv-role", "decode", "--check-invariants"),
        *events_flags((ports[2], ports[3])),
        model=model,
    )
    url = start_front_end(processes, [prefill, decode], ports[4], ["prefill", "decode"], model)
    prompts = shared_prefix_prompts(4, prefix_len=100, tail_len=20, seed=17)
    serve_and_check(url, prompts, first_idx=0, model=model)
    prefill_stats = wait_idle(prefill, "the prefill engine")
    decode_stats = wait_idle(decode, "the decode engine")
    assert prefill_stats["kv_transfer_released"] == len(prompts), prefill_stats
    assert decode_stats["kv_transfer_pulls"] == len(prompts), decode_stats
    assert decode_stats["kv_transfer_failed_pulls"] == 0, decode_stats
    assert_index_matches(url, [prefill, decode], "after hybrid transfers")
    stop_process(processes, "api")
    stop_process(processes, "launch-p")
    stop_process(processes, "launch-d")


@pytest.mark.timeout(600)
def test_a_decode_engine_killed_mid_stream_is_an_engine_loss(
    processes: Processes, ipc_folder: Path
) -> None:
    """The decode engine dies while it streams: its requests end with an error, as with any
    lost engine, and leave no block held on the prefill engine; later requests are served whole
    by the prefill engine, exactly."""
    ports = free_tcp_ports(5)
    prefill = launch_engine(
        processes, ipc_folder, "p", "--kv-role", "prefill", *events_flags((ports[0], ports[1]))
    )
    decode = launch_engine(
        processes, ipc_folder, "d", "--kv-role", "decode", *events_flags((ports[2], ports[3]))
    )
    url = start_front_end(processes, [prefill, decode], ports[4], ["prefill", "decode"])
    prompts = shared_prefix_prompts(4, prefix_len=30, tail_len=10, seed=13)
    body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    def long_request(prompt: list[int]) -> int:
        try:
            answer = httpx.post(
                f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=HTTP_TIMEOUT_S
            )
        except httpx.TransportError:
            return 0
        return answer.status_code

    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(long_request, prompt) for prompt in prompts]
        wait_for(
            lambda: engine_stats(decode)["num_running_reqs"] > 0,
            HTTP_TIMEOUT_S,
            "the decode engine streaming",
        )
        os.killpg(processes.procs["launch-d"].pid, signal.SIGKILL)
        statuses = [answer.result(timeout=HTTP_TIMEOUT_S) for answer in answers]
    processes.procs["launch-d"].wait(10)
    assert all(status != 200 for status in statuses), statuses
    wait_for(
        lambda: not httpx.get(f"{url}/router", timeout=2).json()["engines"][1]["is_routable"],
        HTTP_TIMEOUT_S,
        "the front end marking the decode engine down",
    )
    stats = wait_idle(prefill, "the prefill engine once its decode engine died")
    assert stats["kv_transfer_handles"] == len(prompts)
    serve_and_check(url, shared_prefix_prompts(3, prefix_len=20, tail_len=6, seed=14), 40)
    stop_process(processes, "api")
    stop_process(processes, "launch-p")
