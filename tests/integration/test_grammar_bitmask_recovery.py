"""Constrained requests through a rank fault (DESIGN.md §8) with asynchronous scheduling: a TP=2
deployment of a random-weight checkpoint runs regex-constrained requests, each step's bitmask
following it, while rank 1 is killed. Whatever the ranks were doing (a forward, or waiting for a
bitmask that the engine will not send to a retired generation), the next generation serves
every request to a grammar-valid end and nothing is left behind.
"""

import os
import re
import signal
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.make_checkpoint import CheckpointSpec, make_checkpoint
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams, StructuredOutputs
from tests.integration.conftest import Processes, launch, stop_launch, wait_for

pytestmark = pytest.mark.integration

REGEX = r"[a-z]{20,30}-[0-9]{2,4}"
NUM_CONSTRAINED = 8
NUM_FREE = 4
RECOVERY_TIMEOUT_S = 120.0


def _rank_pid(log: str, rank: int) -> int:
    return int(re.findall(rf"rank {rank} joined: pid (\d+)", log)[-1])


@pytest.mark.timeout(400)
def test_a_killed_rank_costs_constrained_requests_no_grammar_and_no_request(
    processes: Processes, addresses: dict, ipc_folder: Path, tmp_path: Path
) -> None:
    checkpoint = make_checkpoint(tmp_path / "qwen3", CheckpointSpec(arch="qwen3"))
    launch(
        processes,
        addresses,
        2,
        str(checkpoint),
        "--max-model-len",
        "256",
        "--step-timeout-s",
        "5",
        "--worker-rejoin-timeout-s",
        str(RECOVERY_TIMEOUT_S),
        "--max-worker-restarts",
        "1",
    )
    constrained = [
        SamplingParams(
            max_tokens=80,
            temperature=0.0 if idx % 2 else 1.0,
            seed=idx,
            structured_outputs=StructuredOutputs(regex=REGEX),
        )
        for idx in range(NUM_CONSTRAINED)
    ]
    free = [SamplingParams(max_tokens=60, ignore_eos=True) for _ in range(NUM_FREE)]
    req_ids = [f"c{idx}" for idx in range(NUM_CONSTRAINED)] + [f"f{idx}" for idx in range(NUM_FREE)]
    with EngineClient(addresses["client"], 120.0) as client:
        wait_for(lambda: client.check_health(), 180, "the deployment to serve")
        for idx, (req_id, params) in enumerate(zip(req_ids, constrained + free, strict=True)):
            client.add_request(make_request(req_id, [11 + idx, 40, 97, 5], params))

        def num_received() -> int:
            client.poll_outputs(0.05)
            return sum(len(client.result(req_id).token_ids) for req_id in req_ids)

        wait_for(lambda: num_received() >= 40, 120, "the first tokens")
        os.kill(_rank_pid(processes.log("launch"), 1), signal.SIGKILL)
        results = client.run_until_finished(req_ids, RECOVERY_TIMEOUT_S + 120)
        stats = client.get_stats()
    errors = {req_id: result.error for req_id, result in results.items() if result.error}
    assert not errors, f"clients saw errors: {list(errors.items())[:3]}"
    assert stats["num_worker_restarts"] == 1
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for req_id in req_ids[:NUM_CONSTRAINED]:
        result = results[req_id]
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert result.finish_reason == "stop", (req_id, result.finish_reason, text)
        assert re.fullmatch(REGEX, text), (req_id, text)
    for req_id in req_ids[NUM_CONSTRAINED:]:
        assert len(results[req_id].token_ids) == 60, req_id
    assert "replacing the worker ranks" in processes.log("launch")
    stop_launch(processes)
    assert not list(ipc_folder.glob("*.sock")), "socket files left behind"
