"""Cascade attention through the real service (launcher, engine, two workers): requests that
share a long prefix decode together with prefix caching on, every rank reads the prefix once per
layer (its debug log says so), and each served token equals the dense reference. One launch.
"""

import random

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, launch, stop_launch
from worker.models.fake.reference import ReferenceModel

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
CLIENT_TIMEOUT_S = 120.0


@pytest.mark.timeout(240)
def test_requests_sharing_a_prefix_serve_the_reference_tokens_through_cascade_attention(
    processes: Processes, addresses: dict
) -> None:
    launch(
        processes,
        addresses,
        2,
        MODEL,
        "--enable-prefix-caching",
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "256",
        "--log-level",
        "DEBUG",
    )
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(70)]  # 4 full blocks of 16 shared
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(3 + i)] for i in range(8)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.7, seed=i, ignore_eos=True)
        if i % 2
        else SamplingParams(max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]
    req_ids = [f"req-{i}" for i in range(len(prompts))]
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        for req_id, prompt, request_params in zip(req_ids, prompts, params, strict=True):
            client.add_request(make_request(req_id, prompt, request_params))
        results = client.run_until_finished(req_ids, CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    reference = ReferenceModel(MODEL)
    for req_id, prompt, request_params in zip(req_ids, prompts, params, strict=True):
        assert results[req_id].error is None, f"{req_id} failed: {results[req_id].error}"
        expected = reference.generate(prompt, request_params)
        assert results[req_id].token_ids == expected, f"{req_id}: {results[req_id].token_ids}"
    assert stats["prefix_cache_hits"] > 0 and stats["kv_cache_usage"] == 0.0, stats
    stop_launch(processes)
    log = processes.log("launch")
    assert "cascade attention: [64] shared prefix tokens per group" in log, log[-3000:]
