"""tiny-encdec through the real service (launcher, engine, workers): requests bring encoder input,
and the served tokens equal the dense reference at TP=1 and TP=2, prefix caching on and off, block
sizes 16 and 32, chunked prefill, and a pool small enough to force preemption (a resumed request
re-encodes into new cross-attention blocks).

Each launch costs seconds on a loaded machine, so three cases cover every axis at least once
rather than their product.
"""

import random

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, stop_launch
from tests.integration.served_requests import (
    assert_cache_use,
    launch_checked,
    mixed_params,
    serve_and_check,
    shared_prefix_prompts,
)
from worker.models.tiny_encdec_reference import TinyEncDecReference

pytestmark = pytest.mark.integration

MODEL = "tiny-encdec"
CLIENT_TIMEOUT_S = 120.0


def encdec_requests(
    num_requests: int, prefix_len: int, tail_len: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that share one prefix, with own tails, and encoder inputs of 5 to 30 tokens that
    pairs of requests share (so prefix caching has something to hit under one encoder input)."""
    prompts = shared_prefix_prompts(num_requests, prefix_len, tail_len, seed)
    rng = random.Random(seed)
    encoders = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 31))] for _ in range(3)]
    return prompts, [encoders[i // 2 % len(encoders)] for i in range(num_requests)]


def check(
    client: EngineClient, prompts: list[list[int]], encoders: list[list[int]], num_tokens: int
) -> None:
    """Serve every request with its encoder input; outputs must equal the reference's."""
    reference = TinyEncDecReference()

    def expected(idx: int, prompt: list[int], params: SamplingParams) -> list[int]:
        return reference.generate(prompt, encoders[idx], params)

    params = mixed_params(len(prompts), num_tokens)
    serve_and_check(client, prompts, params, expected, CLIENT_TIMEOUT_S, encoders=encoders)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp_size", "block_size", "caching_flag"),
    [(1, 16, "--enable-prefix-caching"), (2, 32, "--no-enable-prefix-caching")],
    ids=["tp1-block16-cached", "tp2-block32-uncached"],
)
def test_chunked_prefills_serve_the_reference_tokens(
    processes: Processes, addresses: dict, tp_size: int, block_size: int, caching_flag: str
) -> None:
    """Prompts of 57 to 62 tokens in steps of at most 24: every prefill runs in three chunks,
    the encoder only in the first; a request without encoder input is refused by name."""
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
    prompts, encoders = encdec_requests(6, 48, 9, seed=tp_size)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        assert client.check_health() is True
        check(client, prompts, encoders, 6)
        refused = client.add_request(make_request("no-encoder", prompts[0]))
        client.run_until_finished(["no-encoder"], CLIENT_TIMEOUT_S)
        stats = client.get_stats()
    assert "brings no encoder_token_ids" in (refused.error or ""), refused.error
    assert_cache_use(stats, caching_flag)
    stop_launch(processes)


@pytest.mark.timeout(240)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes, addresses: dict
) -> None:
    """Three requests grow to 50-52 decoder tokens beside encoder inputs of up to 30 tokens, in
    10 blocks of 16 (9 usable; one request needs 6 at most): some are preempted, lose their
    encoder blocks, and re-encode when they resume."""
    launch_checked(
        processes, addresses, 2, MODEL, "--enable-prefix-caching", 16, 64, num_gpu_blocks=10
    )
    prompts, encoders = encdec_requests(3, 16, 14, seed=7)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        check(client, prompts, encoders, 20)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, f"expected preemption with 10 blocks: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
    stop_launch(processes)
