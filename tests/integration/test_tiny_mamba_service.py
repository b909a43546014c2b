"""tiny-mamba-hybrid through the real service (launcher, engine, workers): served tokens equal the
dense reference at TP=1 and TP=2 with the state channels split over the ranks, prefix caching on
(align mode: checkpoints and hits) and off (one state block per request), block sizes 16 and 32,
chunked prefill, and a pool small enough to force preemption.

Each launch costs seconds on a loaded machine, so three cases cover every axis at least once
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

MODEL = "tiny-mamba-hybrid"
CLIENT_TIMEOUT_S = 180.0


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
        expected = reference_tokens(MODEL)
        serve_and_check(client, prompts[:1], mixed_params(1, 8), expected, CLIENT_TIMEOUT_S)
        params = mixed_params(len(prompts) - 1, 8, first_idx=1)
        serve_and_check(client, prompts[1:], params, expected, CLIENT_TIMEOUT_S, first_idx=1)
        stats = client.get_stats()
    assert_cache_use(stats, caching_flag)
    stop_launch(processes)


@pytest.mark.timeout(300)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes, addresses: dict
) -> None:
    """TP=2, block size 16, caching on: four requests grow to about 60 tokens in a pool of 12
    blocks (11 usable; each request needs four attention blocks and up to two state blocks), so
    some are preempted, resume from a checkpoint or from zero, and recompute their states."""
    launch_checked(
        processes,
        addresses,
        2,
        MODEL,
        "--enable-prefix-caching",
        16,
        80,
        max_num_batched_tokens=32,
        num_gpu_blocks=12,
    )
    prompts = shared_prefix_prompts(4, 16, 14, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        params = mixed_params(len(prompts), 30)
        serve_and_check(client, prompts, params, reference_tokens(MODEL), CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with 12 blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)
