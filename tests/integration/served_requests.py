"""What the per-model integration tests serve and how they check it: prompts sharing a prefix,
greedy and seeded sampling mixed, and every output compared with the model's non-paged reference.
"""

import random
from collections.abc import Callable

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, launch
from worker.models.fake.reference import ReferenceModel

# The reference's tokens for (request index, prompt, sampling parameters).
Expected = Callable[[int, list[int], SamplingParams], list[int]]


def shared_prefix_prompts(
    num_prompts: int, prefix_len: int, tail_len: int, seed: int
) -> list[list[int]]:
    """Prompts that share one prefix (so prefix caching has something to hit), with own tails
    of `tail_len`, `tail_len + 1`, ... tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return [
        prefix + [rng.randrange(3, 500) for _ in range(tail_len + i)] for i in range(num_prompts)
    ]


def mixed_params(num_prompts: int, num_tokens: int, first_idx: int = 0) -> list[SamplingParams]:
    """Greedy requests, and every third one (by index from `first_idx`) sampled with its own
    seed, so no engine-given handle matters."""
    return [
        SamplingParams(max_tokens=num_tokens, temperature=0.8, seed=i, ignore_eos=True)
        if i % 3 == 2
        else SamplingParams(max_tokens=num_tokens, ignore_eos=True)
        for i in range(first_idx, first_idx + num_prompts)
    ]


def serve_and_check(
    client: EngineClient,
    prompts: list[list[int]],
    params: list[SamplingParams],
    expected: Expected,
    timeout_s: float,
    *,
    first_idx: int = 0,
    encoders: list[list[int]] | None = None,
) -> None:
    """Submit every request at once (as `req-<index>`, with its encoder input if given); each
    output must equal `expected`'s tokens for it."""
    indices = range(first_idx, first_idx + len(prompts))
    req_ids = [f"req-{idx}" for idx in indices]
    for pos, (req_id, prompt) in enumerate(zip(req_ids, prompts, strict=True)):
        encoder = None if encoders is None else encoders[pos]
        client.add_request(make_request(req_id, prompt, params[pos], encoder_token_ids=encoder))
    results = client.run_until_finished(req_ids, timeout_s)
    for pos, (idx, req_id, prompt) in enumerate(zip(indices, req_ids, prompts, strict=True)):
        result = results[req_id]
        assert result.error is None, f"{req_id} failed: {result.error}"
        tokens = expected(idx, prompt, params[pos])
        assert result.token_ids == tokens, f"{req_id}: served {result.token_ids}, expected {tokens}"


def reference_tokens(model_name: str) -> Expected:
    """`expected` for a decoder-only model: its ReferenceModel's tokens for each prompt."""
    reference = ReferenceModel(model_name)
    return lambda _idx, prompt, params: reference.generate(prompt, params)


def assert_cache_use(stats: dict, caching_flag: str) -> None:
    """After serving: prefix hits exactly when the cache is on, and no block left held."""
    if caching_flag == "--enable-prefix-caching":
        assert stats["prefix_cache_hits"] > 0, stats
    else:
        assert stats["prefix_cache_hits"] == 0, stats
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"


def launch_checked(
    processes: Processes,
    addresses: dict,
    tp_size: int,
    model: str,
    caching_flag: str,
    block_size: int,
    max_model_len: int,
    *extra: str,
    max_num_batched_tokens: int | None = None,
    num_gpu_blocks: int | None = None,
) -> None:
    """`kvserve launch` of `model` with the engine and the workers checking their invariants
    every step (block tables, null runs, each group's tensors), the step and pool limits given,
    and the `extra` flags; the defaults otherwise."""
    argv = [caching_flag, "--block-size", str(block_size), "--max-model-len", str(max_model_len)]
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks)]
    launch(processes, addresses, tp_size, model, *argv, "--check-invariants", *extra)
