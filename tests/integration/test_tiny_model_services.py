"""tiny-mla, tiny-mamba-hybrid, tiny-local and tiny-encdec through the real service (launcher,
engine, workers): served tokens equal the dense reference at TP=1 and TP=2, prefix caching on and
off, block sizes 16 and 32, chunked prefill, and pools small enough to force preemption.
tiny-encdec's requests bring encoder input, and one without it is refused by name.

Each launch costs seconds on a loaded machine, so each model's cases cover every axis at least once
rather than their product.
"""

import random
from dataclasses import dataclass

import pytest

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from tests.integration.conftest import Processes, stop_launch, wait_engine_serving
from tests.integration.served_requests import (
    Expected,
    assert_cache_use,
    launch_checked,
    mixed_params,
    reference_tokens,
    serve_and_check,
    shared_prefix_prompts,
)
from worker.models.fake.tiny_encdec_reference import TinyEncDecReference

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 180.0
CACHED, UNCACHED = "--enable-prefix-caching", "--no-enable-prefix-caching"
ENCDEC_MODEL = "tiny-encdec"  # its requests carry encoder inputs


@dataclass(frozen=True)
class ServedCase:
    """One launch and the requests served through it."""

    model: str
    tp_size: int
    block_size: int
    caching_flag: str
    max_model_len: int
    num_requests: int
    prefix_len: int  # tokens every prompt shares
    tail_len: int  # the first prompt's own tokens; each later one has one more
    seed: int
    num_tokens: int  # max_tokens of every request
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    is_first_alone: bool = False  # serve the first prompt before the others

    @property
    def id(self) -> str:
        caching = "cached" if self.caching_flag == CACHED else "uncached"
        return f"{self.model}-tp{self.tp_size}-block{self.block_size}-{caching}"


# Positional fields: model, tp_size, block_size, caching_flag, max_model_len, num_requests,
# prefix_len, tail_len, seed, num_tokens.
CHUNKED_CASES = [
    # Prompts of 57 to 62 tokens in steps of at most 24: every prefill runs in three chunks; the
    # latent is replicated on every rank.
    ServedCase("tiny-mla", 1, 16, CACHED, 256, 6, 48, 9, 1, 6, max_num_batched_tokens=24),
    ServedCase("tiny-mla", 2, 32, UNCACHED, 256, 6, 48, 9, 2, 6, max_num_batched_tokens=24),
    # The same prompts; with a cache the chunks end on block boundaries, and the first prompt runs
    # alone, so the others resume from its checkpoint at 32 tokens of the shared 48. The state
    # channels are split over the ranks.
    ServedCase("tiny-mamba-hybrid", 1, 16, CACHED, 256, 6, 48, 9, 1, 8,
               max_num_batched_tokens=24, is_first_alone=True),
    ServedCase("tiny-mamba-hybrid", 2, 32, UNCACHED, 256, 6, 48, 9, 2, 8,
               max_num_batched_tokens=24, is_first_alone=True),
    # Prompts of 49 to 54 tokens cross the 32-token chunk boundary mid-prefill, later requests hit
    # the shared 40-token prefix, and 56 generated tokens each take the R-SWA window past the
    # prompt's blocks, so the engine frees gap blocks and earlier chunks while the workers still
    # read the prompt and the current chunk.
    ServedCase("tiny-local", 1, 16, CACHED, 128, 6, 40, 9, 1, 56, max_num_batched_tokens=24),
    # Prompts of 57 to 62 tokens in steps of at most 24: every prefill runs in three chunks, the
    # encoder only in the first.
    ServedCase(ENCDEC_MODEL, 1, 16, CACHED, 256, 6, 48, 9, 1, 6, max_num_batched_tokens=24),
    ServedCase(ENCDEC_MODEL, 2, 32, UNCACHED, 256, 6, 48, 9, 2, 6, max_num_batched_tokens=24),
]  # fmt: skip

PREEMPTION_CASES = [
    # Each pool is at or near the smallest the engine accepts at max_model_len, so that a
    # preemption does not depend on the requests reaching the engine in the same step. A CI run once
    # read the first request a step or two before the others and finished without one. These
    # cases still preempt when the client sends its requests 100 ms apart, most of a request's
    # lifetime at these sizes.
    #
    # Three requests grow to 60-62 tokens, four blocks of 16 each (the first shares the prefix's
    # block with the others when cached), in a pool of 5 (4 usable): a second request fits beside
    # a first only until one of them needs its third block. The preempted ones resume and
    # recompute their latents. At block size 32 each needs two blocks, in 3 usable.
    ServedCase("tiny-mla", 2, 16, CACHED, 64, 3, 16, 14, 7, 30, num_gpu_blocks=5),
    ServedCase("tiny-mla", 1, 32, UNCACHED, 64, 3, 16, 14, 7, 30, num_gpu_blocks=4),
    # Four requests grow to about 60 tokens in a pool of 9 blocks (8 usable; each request needs
    # four attention blocks and up to two state blocks), so some are preempted, resume from a
    # checkpoint or from zero, and recompute their states.
    ServedCase("tiny-mamba-hybrid", 2, 16, CACHED, 80, 4, 16, 14, 7, 30,
               max_num_batched_tokens=32, num_gpu_blocks=9),
    # Four requests decode 60 to 70 tokens in a pool that holds fewer of them at once (the
    # chunked-local group keeps only its current chunk; full and R-SWA their whole sequence).
    # Preempted requests resume and recompute with the prompt they came with, so R-SWA reads the
    # same positions as before.
    ServedCase("tiny-local", 2, 32, UNCACHED, 96, 4, 12, 10, 7, 70,
               max_num_batched_tokens=32, num_gpu_blocks=12),
    ServedCase("tiny-local", 2, 16, CACHED, 112, 4, 30, 10, 7, 60,
               max_num_batched_tokens=32, num_gpu_blocks=24),
    # Three requests grow to 60-62 decoder tokens beside encoder inputs of up to 30 tokens, in 9
    # blocks of 16 (8 usable; one request needs 6 at most): some are preempted, lose their encoder
    # blocks, and re-encode into new cross-attention blocks when they resume.
    ServedCase(ENCDEC_MODEL, 2, 16, CACHED, 64, 3, 16, 14, 7, 30, num_gpu_blocks=9),
]  # fmt: skip


def encoder_inputs(num_requests: int, seed: int) -> list[list[int]]:
    """Encoder inputs of 5 to 30 tokens that pairs of requests share (so prefix caching has
    something to hit under one encoder input)."""
    rng = random.Random(seed)
    encoders = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 31))] for _ in range(3)]
    return [encoders[i // 2 % len(encoders)] for i in range(num_requests)]


def case_requests(case: ServedCase) -> tuple[list[list[int]], list[list[int]] | None, Expected]:
    """The case's prompts, their encoder inputs (tiny-encdec only), and the reference's tokens."""
    prompts = shared_prefix_prompts(case.num_requests, case.prefix_len, case.tail_len, case.seed)
    if case.model != ENCDEC_MODEL:
        return prompts, None, reference_tokens(case.model)
    encoders = encoder_inputs(case.num_requests, case.seed)
    reference = TinyEncDecReference()
    return (
        prompts,
        encoders,
        lambda idx, prompt, params: reference.generate(prompt, encoders[idx], params),
    )


def assert_refused_without_encoder(client: EngineClient, prompt: list[int]) -> None:
    """A tiny-encdec request that brings no encoder input is refused, naming what it lacks."""
    refused = client.add_request(make_request("no-encoder", prompt))
    client.run_until_finished(["no-encoder"], CLIENT_TIMEOUT_S)
    assert "brings no encoder_token_ids" in (refused.error or ""), refused.error


def serve_case(processes: Processes, addresses: dict, case: ServedCase) -> dict:
    """Launch the case, serve its requests, check every token against the reference; the stats."""
    launch_checked(
        processes,
        addresses,
        case.tp_size,
        case.model,
        case.caching_flag,
        case.block_size,
        case.max_model_len,
        max_num_batched_tokens=case.max_num_batched_tokens,
        num_gpu_blocks=case.num_gpu_blocks,
    )
    prompts, encoders, expected = case_requests(case)

    def serve_requests(client: EngineClient, first_idx: int, end_idx: int) -> None:
        params = mixed_params(end_idx - first_idx, case.num_tokens, first_idx=first_idx)
        serve_and_check(
            client,
            prompts[first_idx:end_idx],
            params,
            expected,
            CLIENT_TIMEOUT_S,
            first_idx=first_idx,
            encoders=None if encoders is None else encoders[first_idx:end_idx],
        )

    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
        first_idx = 1 if case.is_first_alone else 0
        if case.is_first_alone:
            serve_requests(client, 0, 1)
        serve_requests(client, first_idx, len(prompts))
        if case.model == ENCDEC_MODEL:
            assert_refused_without_encoder(client, prompts[0])
        stats = client.get_stats()
    stop_launch(processes)
    return stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CHUNKED_CASES, ids=lambda case: case.id)
def test_chunked_prefills_serve_the_reference_tokens(
    processes: Processes, addresses: dict, case: ServedCase
) -> None:
    stats = serve_case(processes, addresses, case)
    assert_cache_use(stats, case.caching_flag)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", PREEMPTION_CASES, ids=lambda case: case.id)
def test_small_pool_forces_preemption_and_outputs_still_match(
    processes: Processes, addresses: dict, case: ServedCase
) -> None:
    stats = serve_case(processes, addresses, case)
    assert stats["num_preemptions"] > 0, f"expected preemption with {case.num_gpu_blocks}: {stats}"
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"
