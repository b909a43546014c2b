"""fixed-time through the real service: each rank holds a step's reply until the model's device
timeline says it is ready and meanwhile takes and runs the next step (worker/reply_queue.py).
Served tokens equal checksum's reference in both step loops, at TP=2, under preemption and
prefix caching, and an abort mid-stream frees its blocks."""

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, stop_launch, wait_engine_serving, wait_for
from tests.integration.served_requests import (
    assert_cache_use,
    launch_checked,
    mixed_params,
    reference_tokens,
    serve_and_check,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 30.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("loop_flag", ["--async-scheduling", "--no-async-scheduling"])
def test_held_replies_serve_checksums_tokens_under_preemption(
    processes: Processes, addresses: dict, loop_flag: str
) -> None:
    caching_flag = "--enable-prefix-caching"
    launch_checked(
        processes,
        addresses,
        2,
        "fixed-time",
        caching_flag,
        4,
        128,
        loop_flag,
        *("--model-step-ms", "20"),  # long enough that the next step arrives while a reply is held
        max_num_batched_tokens=24,
        num_gpu_blocks=40,  # too few for the batch: preempted and recomputed
    )
    prompts = shared_prefix_prompts(8, 12, 9, seed=3)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
        params = mixed_params(len(prompts), 14)
        serve_and_check(client, prompts, params, reference_tokens("checksum"), CLIENT_TIMEOUT_S)
        stats = client.get_stats()
        assert stats["num_preemptions"] > 0, stats
        # a long request aborted once it streams: its tokens so far are the reference's prefix
        long_params = SamplingParams(max_tokens=100, ignore_eos=True)
        result = client.add_request(make_request("aborted", prompts[0], long_params))
        wait_for(lambda: client.poll_outputs(0.1) or result.token_ids, 60, "first tokens")
        client.abort(["aborted"])
        finished = client.run_until_finished(["aborted"], STATS_TIMEOUT_S)["aborted"]
        assert finished.finish_reason == "abort"
        expected = reference_tokens("checksum")(0, prompts[0], long_params)
        assert 0 < len(finished.token_ids) < 100
        assert finished.token_ids == expected[: len(finished.token_ids)]
        stats = client.get_stats()
    assert_cache_use(stats, caching_flag)
    stop_launch(processes)
