"""tiny-mamba-hybrid through the real service (launcher, engine, workers): served tokens equal the
dense reference at TP=1 and TP=2 with the state channels split over the ranks, prefix caching on
(align mode: checkpoints and hits) and off (one state block per request), block sizes 16 and 32,
chunked prefill, and a pool small enough to force preemption.

Each launch costs seconds on a loaded machine, so three cases cover every axis at least once
rather than their product.
"""

import random

import pytest

from engine_core.client import EngineClient, make_request
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, launch, stop_launch
from worker.models.reference import ReferenceModel

pytestmark = pytest.mark.integration

MODEL = "tiny-mamba-hybrid"
CLIENT_TIMEOUT_S = 180.0


def shared_prefix_prompts(
    num_prompts: int, prefix_len: int, tail_len: int, seed: int
) -> list[list[int]]:
    """Prompts that share one prefix (so prefix caching has something to hit), with own tails."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return [
        prefix + [rng.randrange(3, 500) for _ in range(tail_len + i)] for i in range(num_prompts)
    ]


def mixed_params(num_prompts: int, num_tokens: int) -> list[SamplingParams]:
    """Greedy requests, and every third one sampled with its own seed (so no handle matters)."""
    return [
        SamplingParams(max_tokens=num_tokens, temperature=0.8, seed=i, ignore_eos=True)
        if i % 3 == 2
        else SamplingParams(max_tokens=num_tokens, ignore_eos=True)
        for i in range(num_prompts)
    ]


def serve_and_check(
    client: EngineClient, prompts: list[list[int]], num_tokens: int, first_idx: int = 0
) -> None:
    """Submit every prompt at once; each output must equal the reference model's."""
    params = mixed_params(first_idx + len(prompts), num_tokens)[first_idx:]
    req_ids = [f"req-{first_idx + i}" for i in range(len(prompts))]
    for req_id, prompt, request_params in zip(req_ids, prompts, params, strict=True):
        client.add_request(make_request(req_id, prompt, request_params))
    results = client.run_until_finished(req_ids, CLIENT_TIMEOUT_S)
    reference = ReferenceModel(MODEL)
    for req_id, prompt, request_params in zip(req_ids, prompts, params, strict=True):
        result = results[req_id]
        assert result.error is None, f"{req_id} failed: {result.error}"
        expected = reference.generate(prompt, request_params)
        assert result.token_ids == expected, (
            f"{req_id}: served {result.token_ids}, expected {expected}"
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tp_size", "block_size", "caching_flag"),
    [(1, 16, "--enable-prefix-caching"), (2, 32, "--no-enable-prefix-caching")],
    ids=["tp1-block16-cached", "tp2-block32-uncached"],
)
def test_chunked_prefills_serve_the_reference_tokens(
    processes: Processes, addresses: dict, tp_size: int, block_size: int, caching_flag: str
) -> None:
    """Prompts of 57 to 62 tokens in steps of at most 24: every prefill runs in chunks (with a
    cache, ending on block boundaries). The first prompt runs alone, so with a cache the others
    resume from its checkpoint at 32 tokens of the shared 48."""
    launch(
        processes,
        addresses,
        tp_size,
        MODEL,
        caching_flag,
        "--block-size",
        str(block_size),
        "--max-num-batched-tokens",
        "24",
        "--max-model-len",
        "256",
        "--check-invariants",  # the workers check every state tensor's shape and null block
    )
    prompts = shared_prefix_prompts(6, 48, 9, seed=tp_size)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True
        serve_and_check(client, prompts[:1], 8)
        serve_and_check(client, prompts[1:], 8, first_idx=1)
        stats = client.get_stats()
    if caching_flag == "--enable-prefix-caching":
        assert stats["prefix_cache_hits"] > 0, stats
    else:
        assert stats["prefix_cache_hits"] == 0, stats
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)


@pytest.mark.timeout(300)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes, addresses: dict
) -> None:
    """TP=2, block size 16, caching on: four requests grow to about 60 tokens in a pool of 12
    blocks (11 usable; each request needs four attention blocks and up to two state blocks), so
    some are preempted, resume from a checkpoint or from zero, and recompute their states."""
    launch(
        processes,
        addresses,
        2,
        MODEL,
        "--enable-prefix-caching",
        "--block-size",
        "16",
        "--num-gpu-blocks-override",
        "12",
        "--max-num-batched-tokens",
        "32",
        "--max-model-len",
        "80",
        "--check-invariants",
    )
    prompts = shared_prefix_prompts(4, 16, 14, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        serve_and_check(client, prompts, 30)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with 12 blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)
