"""CURVE on tcp: a deployment with keys serves tokens equal to the reference, while rogue DEALERs
with no key or a wrong key, on the worker and the client socket, before the handshake and while
serving, get nothing through (the engine logs each refusal, keyless ones too, with the peer's
address) and a keyless KV-event subscriber receives nothing. Also: an exposed address without
keys is refused before anything starts.
"""

import json
import re
from pathlib import Path

import pytest
import zmq

from deploy.keys import keygen, load_curve_keys
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.codec import make_encoder
from protocol.config import CurveKeys
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, free_tcp_ports, launch, stop_launch, wait_for
from worker.models.fake.reference import reference_generate

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 90.0
QUIET_MS = 1500  # a rogue or keyless subscriber must stay unanswered this long
MODEL = "checksum"


def tcp_addresses() -> dict[str, str]:
    client, worker, events, master = free_tcp_ports(4)
    return {
        "client": f"tcp://127.0.0.1:{client}",
        "worker": f"tcp://127.0.0.1:{worker}",
        "events": f"tcp://127.0.0.1:{events}",
        "master_port": str(master),
    }


def rogue(ctx: zmq.Context, address: str, keys: CurveKeys | None, frame: bytes) -> zmq.Socket:
    """A DEALER that sends `frame` to `address`: with no key (NULL), or as a CURVE client whose
    keypair the engine never authorized."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public_key, secret_key = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    sock.connect(address)
    sock.send(frame, zmq.NOBLOCK)  # queued until a handshake succeeds, which it never does
    return sock


def rogues(ctx: zmq.Context, addresses: dict[str, str], keys: CurveKeys) -> list[zmq.Socket]:
    """No key and a wrong key, on the worker socket and on the client socket; each sends a frame
    the engine would answer (a worker is told to exit, a request gets outputs)."""
    request = make_encoder().encode(make_request("rogue", [5, 6, 7], SamplingParams(max_tokens=2)))
    return [
        rogue(ctx, addresses[name], curve, frame)
        for name, frame in (("worker", b"not a hello"), ("client", request))
        for curve in (None, keys)
    ]


def serve_and_check(client: EngineClient, num_prompts: int) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [
        [3 + i, 40 + i, *range(90, 110), 17 + 2 * i] for i in range(num_prompts)
    ]  # > a block
    req_ids = [f"req-{i}" for i in range(num_prompts)]
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        client.add_request(make_request(req_id, prompt, params))
    results = client.run_until_finished(req_ids, CLIENT_TIMEOUT_S)
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        assert results[req_id].error is None, f"{req_id}: {results[req_id].error}"
        assert results[req_id].token_ids == reference_generate(MODEL, prompt, params), req_id


def assert_unanswered(socks: list[zmq.Socket], what: str) -> None:
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    events = poller.poll(QUIET_MS)
    assert not events, f"{what} received {len(events)} answers"


@pytest.mark.timeout(150)
def test_keys_admit_the_deployment_and_nothing_else(processes: Processes, tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keygen(keys_dir)
    client_keys = load_curve_keys(keys_dir, "client")
    addresses = tcp_addresses()
    events = {"enable_kv_cache_events": True, "endpoint": addresses["events"], "topic": "kv"}
    ctx = zmq.Context()
    early = rogues(ctx, addresses, client_keys)  # they connect while the engine starts
    keyless_sub = ctx.socket(zmq.SUB)
    keyed_sub = ctx.socket(zmq.SUB)
    keyed_sub.setsockopt(zmq.CURVE_SERVERKEY, client_keys.server_public_key.encode())
    keyed_sub.setsockopt(zmq.CURVE_PUBLICKEY, client_keys.public_key.encode())
    keyed_sub.setsockopt(zmq.CURVE_SECRETKEY, client_keys.secret_key.encode())
    for sub in (keyless_sub, keyed_sub):
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(addresses["events"])
    launch(
        processes,
        addresses,
        2,
        MODEL,
        "--curve-keys-dir",
        str(keys_dir),
        "--kv-events-config",
        json.dumps(events),
    )
    try:
        with EngineClient(addresses["client"], CLIENT_TIMEOUT_S, client_keys) as client:
            assert client.check_health() is True
            late = rogues(ctx, addresses, client_keys)  # while serving
            serve_and_check(client, 6)
            assert_unanswered(early + late, "a rogue")
            assert keyed_sub.poll(QUIET_MS), "an authorized subscriber got no KV events"
            assert not keyless_sub.poll(0), "a keyless subscriber got KV events"
            serve_and_check(client, 3)  # the deployment keeps serving exactly
        wait_for(
            lambda: "at 127.0.0.1 on --client-address: Unknown key" in processes.log("launch"),
            10,
            "the engine logging a refused client",
        )
        log = processes.log("launch")
        assert "refused a peer at 127.0.0.1 on --worker-address: Unknown key" in log  # by ZAP
        assert "on --kv-events-config: Unknown key" not in log  # no subscriber had a wrong key
        # Keyless peers fail the CURVE handshake before ZAP hears of them; a monitor logs them,
        # with their address when their connection could be read before it closed.
        for flag in ("--worker-address", "--client-address", "--kv-events-config"):
            peer = "(127\\.0\\.0\\.1|an address that closed before it could be read)"
            keyless = re.compile(rf"refused a peer at {peer} on {flag}: (no|its) CURVE")
            wait_for(
                lambda keyless=keyless: keyless.search(processes.log("launch")),
                10,
                f"the engine logging a keyless peer on {flag}",
            )
        stop_launch(processes)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_an_exposed_address_without_keys_is_a_usage_error(processes: Processes) -> None:
    addresses = tcp_addresses()
    addresses["client"] = addresses["client"].replace("127.0.0.1", "0.0.0.0")
    launch(processes, addresses, 1, MODEL)
    assert processes.wait_exit("launch", 30) == 2
    errors = [line for line in processes.log("launch").splitlines() if "error" in line]
    assert len(errors) == 1, errors
    assert f"--client-address {addresses['client']}" in errors[0]
    assert "kvserve keygen DIR" in errors[0] and "--insecure" in errors[0]
