"""A rank that dies or freezes mid-collective never leaves a survivor hanging: a killed peer fails
the collective at once (the shared-memory all-reduce of same-host CPU ranks sees its pid gone),
and a rank whose step waits in a collective on a frozen peer (its own process-group timeout far
away) still obeys the engine's Shutdown, while the launcher's grace period kills the frozen peer.
"""

import os
import re
import signal
import time

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, launch, wait_for

pytestmark = pytest.mark.integration

STEP_TIMEOUT_S = "2"
DIST_TIMEOUT_S = "600"  # far past the test: only the launcher can end a rank stuck in a collective
SHUTDOWN_TIMEOUT_S = "1"
# the launcher's grace: the engine's step deadline, shutdown_timeout_s plus its 5 s join, 3 s
# after SIGTERM, 3 s after SIGKILL, and slack for a busy machine
GRACE_S = 40.0


def _launch_and_serve_one_request(
    processes: Processes, addresses: dict
) -> tuple[EngineClient, int]:
    """A TP=2 checksum deployment that served one request; the client and rank 1's pid."""
    launch(
        processes,
        addresses,
        2,
        "checksum",
        "--step-timeout-s",
        STEP_TIMEOUT_S,
        "--dist-timeout-s",
        DIST_TIMEOUT_S,
        "--shutdown-timeout-s",
        SHUTDOWN_TIMEOUT_S,
        "--max-model-len",
        "8192",
        "--max-worker-restarts",
        "0",  # fail-stop: these tests are about tearing down, not recovering
    )
    client = EngineClient(addresses["client"], 60.0)
    client.add_request(make_request("warmup", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert client.run_until_finished(["warmup"], 60)["warmup"].finish_reason == "length"
    victim = int(re.search(r"rank 1 joined: pid (\d+)", processes.log("launch")).group(1))
    return client, victim


def _wait_until_idle(client: EngineClient) -> None:
    """Until the engine's step count holds still across three polls."""
    seen: list[int] = []

    def is_idle() -> bool:
        seen.append(int(client.get_stats()["num_steps"]))
        return len(seen) >= 3 and seen[-1] == seen[-3]

    wait_for(is_idle, 30, "the engine to go idle")


def _wait_for_the_launcher(processes: Processes, faulted: float) -> str:
    """The launcher exits 1 within the grace period; its log."""
    assert processes.wait_exit("launch", GRACE_S) == 1
    assert time.monotonic() - faulted < GRACE_S
    return processes.log("launch")


@pytest.mark.timeout(150)
def test_a_rank_killed_mid_decode_fails_its_peers_collective_and_all_exit(
    processes: Processes, addresses: dict
) -> None:
    """Rank 0's all-reduce sees the killed victim gone, and fails at once."""
    client, victim = _launch_and_serve_one_request(processes, addresses)
    with client:
        params = SamplingParams(max_tokens=8000, ignore_eos=True)
        client.add_request(make_request("endless", [5, 6, 7], params))

        def has_decoded() -> bool:
            client.poll_outputs(0.1)
            return len(client.result("endless").token_ids) > 20

        wait_for(has_decoded, 60, "twenty decode steps")
        os.kill(victim, signal.SIGKILL)
        faulted = time.monotonic()
        assert client.run_until_finished(["endless"], 30)["endless"].finish_reason == "error"
    _wait_for_the_launcher(processes, faulted)
    # the processes fixture then checks that no engine, rank or grandchild is left alive


@pytest.mark.timeout(150)
def test_a_rank_whose_step_waits_on_a_frozen_peer_obeys_shutdown_and_the_peer_is_killed(
    processes: Processes, addresses: dict
) -> None:
    """Rank 1 is frozen while the engine is idle, so the next step finds rank 0 alone in the
    all-reduce, with its process-group timeout far away. Its step thread waits there, but its
    worker thread still hears the engine's Shutdown and exits; only the frozen rank needs the
    launcher's SIGKILL."""
    client, victim = _launch_and_serve_one_request(processes, addresses)
    with client:
        _wait_until_idle(client)  # the step that tells the ranks to forget warmup has run
        os.kill(victim, signal.SIGSTOP)
        faulted = time.monotonic()
        client.add_request(make_request("stuck", [5, 6, 7], SamplingParams(max_tokens=4)))
        assert client.run_until_finished(["stuck"], 30)["stuck"].finish_reason == "error"
    log = _wait_for_the_launcher(processes, faulted)
    assert "[worker-0] worker.worker: stopping: worker failure" in log, log[-3000:]
    assert "worker-0 ignored SIGTERM" not in log, log[-3000:]
    assert "worker-1 ignored SIGTERM: killing" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
