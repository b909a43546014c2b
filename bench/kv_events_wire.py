"""Checks kvserve's KV events against vLLM 0.33.0's own decoder: starts a deployment with events
on, runs a workload that evicts and resets while bench/peers/vllm_kv_events_check.py reads the
live stream and a replay in the peer environment, then prints PASS/FAIL lines.

Run: python -m bench.kv_events_wire --peer-python DIR/bin/python [--json FILE]
"""

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import DEFAULT_PEER_PYTHON
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from engine_core.net.endpoints import free_tcp_ports
from protocol.sampling import SamplingParams

PEER_SCRIPT = Path(__file__).parent / "peers" / "vllm_kv_events_check.py"
TOPIC = "kv"
CLIENT_TIMEOUT_S = 120.0
PEER_READY_TIMEOUT_S = 120.0  # importing vLLM takes a while
PEER_TIMEOUT_S = 120.0  # for the peer to finish once told to stop
STOP_TIMEOUT_S = 30.0
GROUP_ID_NUM_BYTES = 4  # the engine's map keys end with the group id, big-endian


def launch(folder: str, events_config: dict) -> subprocess.Popen:
    """`kvserve launch` at TP=1 on the CPU with a 24-block pool, logging to FOLDER/launch.log."""
    (master_port,) = free_tcp_ports(1)
    args = ["launch", "-tp", "1", "--model", "checksum", "--device", "cpu"]
    args += ["--client-address", f"ipc://{folder}/client.sock"]
    args += ["--worker-address", f"ipc://{folder}/worker.sock", "--master-port", str(master_port)]
    args += ["--kv-cache-memory-bytes", str(1 << 22), "--num-gpu-blocks-override", "24"]
    args += ["--max-model-len", "256", "--kv-events-config", json.dumps(events_config)]
    kvserve = Path(sys.executable).parent / "kvserve"
    log = open(Path(folder) / "launch.log", "wb")  # noqa: SIM115  # closed with the process
    return subprocess.Popen([str(kvserve), *args], stdout=log, stderr=subprocess.STDOUT)


def start_peer(peer_python: str, events_config: dict) -> subprocess.Popen:
    """The vLLM-side subscriber; returns once it says it is subscribed."""
    if not os.path.exists(peer_python):
        sys.exit(f"peer python {peer_python} not found: bash bench/peers/setup.sh DIR")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    args = ["--endpoint", events_config["endpoint"], "--topic", TOPIC]
    args += ["--replay-endpoint", events_config["replay_endpoint"]]
    peer = subprocess.Popen(
        [peer_python, str(PEER_SCRIPT), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if not select.select([peer.stdout], [], [], PEER_READY_TIMEOUT_S)[0]:
        peer.kill()
        raise TimeoutError(f"the peer did not subscribe in {PEER_READY_TIMEOUT_S} s")
    line = peer.stdout.readline().strip()
    if line != "ready":
        peer.kill()
        sys.exit(f"the peer failed to start: said {line!r}, exit code {peer.wait(10)}")
    return peer


def run_workload(client: EngineClient) -> dict[str, int]:
    """Three waves on one 48-token prefix each (two identical prompts a wave), a reset before the
    last; the pool of 24 blocks evicts. Returns the engine's map: `hash_hex:group_idx` -> copies."""
    for wave in range(3):
        if wave == 2 and client.reset_prefix_cache() is not True:
            sys.exit("the engine refused to reset its prefix cache while idle")
        rng = random.Random(wave)
        prefix = [rng.randrange(3, 500) for _ in range(48)]
        tails = [[rng.randrange(3, 500) for _ in range(8 + 4 * i)] for i in range(5)]
        prompts = [prefix + tail for tail in tails] + [prefix + tails[0]]
        req_ids = [f"{wave}-{i}" for i in range(len(prompts))]
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for req_id, prompt in zip(req_ids, prompts, strict=True):
            client.add_request(make_request(req_id, prompt, params))
        for req_id, result in client.run_until_finished(req_ids, CLIENT_TIMEOUT_S).items():
            if result.error is not None:
                sys.exit(f"{req_id} failed: {result.error}")
    counts = client.call_utility("get_cached_block_hashes")
    if not isinstance(counts, dict):
        sys.exit(f"get_cached_block_hashes answered {counts!r}")
    return {
        f"{key[: -2 * GROUP_ID_NUM_BYTES]}:{int(key[-2 * GROUP_ID_NUM_BYTES :], 16)}": num
        for key, num in counts.items()
    }


def verdicts(peer: dict, engine_map: dict[str, int]) -> dict[str, bool]:
    live, replay = peer["live"], peer["replay"]
    counts = replay["event_counts"]
    return {
        "every live frame decodes with vLLM's KVEventBatch decoder": peer["num_live"] > 0
        and live["num_decode_errors"] == 0,
        "vLLM's encoder writes every frame back byte for byte": live["num_reencode_mismatches"] == 0
        and replay["num_reencode_mismatches"] == 0,
        "live frames carry the topic and consecutive sequence numbers": peer["is_live_consecutive"]
        and peer["num_live_wrong_topic"] == 0,
        "events say medium GPU and data-parallel rank 0": live["media"] == ["GPU"]
        and live["data_parallel_ranks"] == ["0"],
        "replay from 0 answers (b'', topic, seq, payload) for every batch": peer[
            "is_replay_shape_vllms"
        ]
        and peer["is_replay_from_0_complete"]
        and replay["num_decode_errors"] == 0,
        "replay ends with vLLM's marker (b'', b'', -1, b'')": peer["is_end_marker_vllms"],
        "replay from a middle seq answers from that seq": peer["is_middle_replay_right"],
        "replayed payloads equal the live ones": peer["num_live_replay_mismatches"] == 0,
        "the stream has stores, removals and a clear": min(counts.values()) > 0,
        "the map rebuilt from the replay equals the engine's": sorted(engine_map) == replay["keys"],
    }


def stop(launcher: subprocess.Popen) -> int:
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        return launcher.wait(STOP_TIMEOUT_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the findings to FILE as JSON")
    parser.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="python of the peer")
    args = parser.parse_args()
    port, replay_port = free_tcp_ports(2)
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC,
    }
    with tempfile.TemporaryDirectory(prefix="kvs-wire-") as folder:
        launcher = launch(folder, events_config)
        peer = start_peer(args.peer_python, events_config)
        try:
            with EngineClient(f"ipc://{folder}/client.sock", CLIENT_TIMEOUT_S) as client:
                client.check_health()
                started_s = time.monotonic()
                engine_map = run_workload(client)
                workload_s = time.monotonic() - started_s
            output, _ = peer.communicate("stop\n", timeout=PEER_TIMEOUT_S)
        finally:
            if peer.poll() is None:
                peer.kill()
            exit_code = stop(launcher)
    if peer.returncode != 0:
        sys.exit(f"the peer check failed with exit code {peer.returncode}")
    found = json.loads(output.strip().splitlines()[-1])
    checks = verdicts(found, engine_map)
    checks["the deployment shut down cleanly"] = exit_code == 0
    for name, is_passed in checks.items():
        print(f"{'PASS' if is_passed else 'FAIL'}  {name}")
    summary = {
        "num_live_batches": found["num_live"],
        "num_replayed_batches": found["num_replayed"],
        "event_counts": found["replay"]["event_counts"],
        "num_engine_hashes": len(engine_map),
        "workload_s": round(workload_s, 3),
        "checks": checks,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "checks"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
