"""tiny-local through the real service (launcher, engine, workers): served tokens equal the dense
reference at TP=1 and TP=2, prefix caching on and off, block sizes 16 and 32, chunked prefill, and
pools small enough to force preemption.

Every request decodes far enough past its prompt that the engine frees R-SWA gap blocks and
earlier chunks while the workers still read the prompt and the current chunk. Each launch costs
seconds on a loaded machine, so three cases cover every axis at least once rather than their
product.
"""

import pytest

from engine_client.sync_client import EngineClient
from tests.integration.conftest import Processes, stop_launch
from tests.integration.served_requests import (
    launch_checked,
    mixed_params,
    reference_tokens,
    serve_and_check,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.integration

MODEL = "tiny-local"
CLIENT_TIMEOUT_S = 180.0


@pytest.mark.timeout(300)
def test_chunked_prefills_with_prefix_hits_serve_the_reference_tokens(
    processes: Processes, addresses: dict
) -> None:
    """TP=1, block size 16, caching on: prompts of 49 to 54 tokens in steps of at most 24 cross
    the 32-token chunk boundary mid-prefill, later requests hit the shared 40-token prefix, and
    56 generated tokens each take the R-SWA window past the prompt's blocks."""
    launch_checked(
        processes,
        addresses,
        1,
        MODEL,
        "--enable-prefix-caching",
        16,
        128,
        max_num_batched_tokens=24,
    )
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True
        prompts = shared_prefix_prompts(6, 40, 9, seed=1)
        serve_and_check(
            client, prompts, mixed_params(6, 56), reference_tokens(MODEL), CLIENT_TIMEOUT_S
        )
        stats = client.get_stats()
    assert stats["prefix_cache_hits"] > 0, stats
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("block_size", "caching_flag", "num_blocks", "max_model_len", "prefix_len"),
    [(32, "--no-enable-prefix-caching", 12, 96, 12), (16, "--enable-prefix-caching", 24, 112, 30)],
    ids=["tp2-block32-uncached", "tp2-block16-cached"],
)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes,
    addresses: dict,
    block_size: int,
    caching_flag: str,
    num_blocks: int,
    max_model_len: int,
    prefix_len: int,
) -> None:
    """TP=2: four requests decode 60 to 70 tokens in a pool that holds fewer of them at once (the
    chunked-local group keeps only its current chunk; full and R-SWA their whole sequence).
    Preempted requests resume and recompute with the prompt they came with, so R-SWA reads the
    same positions as before."""
    launch_checked(
        processes,
        addresses,
        2,
        MODEL,
        caching_flag,
        block_size,
        max_model_len,
        max_num_batched_tokens=32,
        num_gpu_blocks=num_blocks,
    )
    num_tokens = 70 if block_size == 32 else 60
    prompts = shared_prefix_prompts(4, prefix_len, 10, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        params = mixed_params(len(prompts), num_tokens)
        serve_and_check(client, prompts, params, reference_tokens(MODEL), CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with {num_blocks} blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)
