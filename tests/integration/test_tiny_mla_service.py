"""tiny-mla through the real service (launcher, engine, workers): served tokens equal the dense
reference at TP=1 and TP=2 with the latent replicated on every rank, prefix caching on and off,
block sizes 16 and 32, chunked prefill, and a pool small enough to force preemption.

Each launch costs seconds on a loaded machine, so the four cases cover every axis at least once
rather than their product.
"""

import pytest

from engine_client.sync_client import EngineClient
from tests.integration.conftest import Processes, stop_launch
from tests.integration.served_requests import (
    assert_cache_use,
    launch_checked,
    mixed_params,
    reference_tokens,
    serve_and_check,
    shared_prefix_prompts,
)

pytestmark = pytest.mark.integration

MODEL = "tiny-mla"
CLIENT_TIMEOUT_S = 120.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp_size", "block_size", "caching_flag"),
    [(1, 16, "--enable-prefix-caching"), (2, 32, "--no-enable-prefix-caching")],
    ids=["tp1-block16-cached", "tp2-block32-uncached"],
)
def test_chunked_prefills_serve_the_reference_tokens(
    processes: Processes, addresses: dict, tp_size: int, block_size: int, caching_flag: str
) -> None:
    """Prompts of 57 to 62 tokens in steps of at most 24: every prefill runs in three chunks."""
    launch_checked(
        processes,
        addresses,
        tp_size,
        MODEL,
        caching_flag,
        block_size,
        256,
        max_num_batched_tokens=24,
    )
    prompts = shared_prefix_prompts(6, 48, 9, seed=tp_size)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True
        params = mixed_params(len(prompts), 6)
        serve_and_check(client, prompts, params, reference_tokens(MODEL), CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    assert_cache_use(stats, caching_flag)
    stop_launch(processes)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp_size", "block_size", "caching_flag", "num_blocks"),
    [(2, 16, "--enable-prefix-caching", 10), (1, 32, "--no-enable-prefix-caching", 5)],
    ids=["tp2-block16-cached", "tp1-block32-uncached"],
)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes,
    addresses: dict,
    tp_size: int,
    block_size: int,
    caching_flag: str,
    num_blocks: int,
) -> None:
    """Three requests grow to 50-52 tokens in a pool of fewer blocks than they need together
    (at block size 16 they share the prefix's block when cached: 10 blocks of 9 usable): some
    are preempted, resumed and recompute their latents."""
    launch_checked(
        processes,
        addresses,
        tp_size,
        MODEL,
        caching_flag,
        block_size,
        64,
        num_gpu_blocks=num_blocks,
    )
    prompts = shared_prefix_prompts(3, 16, 14, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        params = mixed_params(len(prompts), 20)
        serve_and_check(client, prompts, params, reference_tokens(MODEL), CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with {num_blocks} blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)
