"""A deterministic, seeded serving trace for the KV-cache benchmarks; standard library only.

`make_trace(TraceConfig(...))` gives the same tokens in any process: a peer (which must not import
kvserve) rebuilds it from `config_to_json(config)`, both sides compare `trace_digest(trace)`, and
`replay_through_pool()` runs the same loop through any pool with the vLLM v1 BlockPool API.
"""

import dataclasses
import hashlib
import json
import random
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GROUP_IDS = [0]  # the trace has one KV-cache group


@dataclass(frozen=True)  # no slots, so `TraceConfig.num_requests` reads as the default
class TraceConfig:
    """The shape of the workload; every size in tokens unless named otherwise."""

    seed: int = 0
    num_requests: int = 2000
    block_size: int = 16
    num_system_prompts: int = 8  # shared prefixes; prompt k is chosen with weight 1 / (k + 1)
    system_prompt_min_tokens: int = 1024
    system_prompt_max_tokens: int = 4096
    shared_fraction: float = 0.9  # requests that start with a system prompt; others are unique
    suffix_min_tokens: int = 16  # the user's own part of the prompt
    suffix_max_tokens: int = 512
    output_min_tokens: int = 16
    output_max_tokens: int = 256
    vocab_size: int = 32_000
    num_gpu_blocks: int = 2048  # the pool; small enough that cached prefixes get evicted
    max_running: int = 32  # requests holding blocks at once; the oldest finishes first


@dataclass(frozen=True, slots=True)
class TraceRequest:
    req_id: str
    system_prompt_idx: int | None  # index into Trace.system_prompts, None for a unique prompt
    suffix_token_ids: list[int]
    output_token_ids: list[int]  # the tokens the request generates before it finishes


@dataclass(frozen=True, slots=True)
class Trace:
    config: TraceConfig
    system_prompts: list[list[int]]
    requests: list[TraceRequest]

    def prompt_len(self, request: TraceRequest) -> int:
        return self._system_len(request) + len(request.suffix_token_ids)

    def token_ids(self, request: TraceRequest) -> list[int]:
        """Prompt then output: the whole sequence whose full blocks get cached."""
        system = (
            []
            if request.system_prompt_idx is None
            else self.system_prompts[request.system_prompt_idx]
        )
        return system + request.suffix_token_ids + request.output_token_ids

    def _system_len(self, request: TraceRequest) -> int:
        idx = request.system_prompt_idx
        return 0 if idx is None else len(self.system_prompts[idx])


def _tokens(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def make_trace(config: TraceConfig) -> Trace:
    """Build the trace; the same config gives the same trace in every process and version."""
    rng = random.Random(config.seed)
    system_prompts = [
        _tokens(
            rng,
            config.vocab_size,
            rng.randint(config.system_prompt_min_tokens, config.system_prompt_max_tokens),
        )
        for _ in range(config.num_system_prompts)
    ]
    weights = [1.0 / (k + 1) for k in range(config.num_system_prompts)]
    requests = []
    for idx in range(config.num_requests):
        is_shared = rng.random() < config.shared_fraction
        system_idx = (
            rng.choices(range(config.num_system_prompts), weights)[0] if is_shared else None
        )
        suffix_len = rng.randint(config.suffix_min_tokens, config.suffix_max_tokens)
        output_len = rng.randint(config.output_min_tokens, config.output_max_tokens)
        requests.append(
            TraceRequest(
                req_id=f"req-{idx}",
                system_prompt_idx=system_idx,
                suffix_token_ids=_tokens(rng, config.vocab_size, suffix_len),
                output_token_ids=_tokens(rng, config.vocab_size, output_len),
            )
        )
    return Trace(config, system_prompts, requests)


def trace_digest(trace: Trace) -> str:
    """A sha256 over every request's tokens and prompt length, to check two sides agree."""
    digest = hashlib.sha256()
    for request in trace.requests:
        digest.update(trace.prompt_len(request).to_bytes(4, "little"))
        digest.update(array("i", trace.token_ids(request)).tobytes())
    return digest.hexdigest()


def config_to_json(config: TraceConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_json(text: str) -> TraceConfig:
    return TraceConfig(**json.loads(text))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """What one request asks of the pool, derived from the trace alone."""

    num_prompt_tokens: int
    num_tokens: int  # prompt plus output
    max_hit_blocks: int  # the hit is capped so that the last prompt token is computed
    num_prompt_full_blocks: int  # cached at admission
    num_full_blocks: int  # cached when the request finishes, output included
    num_blocks: int  # blocks the whole sequence needs


def replay_plan(trace: Trace) -> list[ReplayStep]:
    """The replay rule, identical for every pool under test. For each request, in order:

    1. hash every full block of its tokens (prompt and output);
    2. look up the prompt's hashes left to right, stopping at the first miss or after
       `max_hit_blocks`;
    3. while the free blocks, minus the hit blocks that sit free, cannot hold the
       `num_blocks - hits` new blocks, free the oldest running request tail first;
    4. touch the hits, allocate the new blocks, cache blocks [hits, num_prompt_full_blocks);
    5. if more than `max_running` requests hold blocks, finish the oldest: cache its blocks
       [num_prompt_full_blocks, num_full_blocks), then free its blocks tail first.
    At the end every running request finishes, oldest first, and every block is free again.
    """
    block_size = trace.config.block_size
    steps = []
    for request in trace.requests:
        num_prompt = trace.prompt_len(request)
        num_tokens = num_prompt + len(request.output_token_ids)
        steps.append(
            ReplayStep(
                num_prompt_tokens=num_prompt,
                num_tokens=num_tokens,
                max_hit_blocks=(num_prompt - 1) // block_size,
                num_prompt_full_blocks=num_prompt // block_size,
                num_full_blocks=num_tokens // block_size,
                num_blocks=cdiv(num_tokens, block_size),
            )
        )
    return steps


class ReplayRequest:
    """What a BlockPool reads from a request: its ids, block hashes and token ids."""

    __slots__ = ("all_token_ids", "block_hashes", "req_id", "request_id")

    def __init__(
        self, req_id: str, block_hashes: list[bytes], all_token_ids: Sequence[int]
    ) -> None:
        self.req_id = self.request_id = req_id  # kvserve and vLLM name it differently
        self.block_hashes = block_hashes
        self.all_token_ids = all_token_ids


@dataclass(frozen=True, slots=True)
class ReplayResult:
    num_hit_blocks: int
    num_evicted_blocks: int  # cached blocks reused for new content; counted only on request


def _num_hashed_at_head(pool: Any, num_blocks: int) -> int:
    """Cached blocks among the next `num_blocks` to be handed out (a walk; validation only)."""
    count, block = 0, pool.free_block_queue.fake_free_list_head.next_free_block
    for _ in range(num_blocks):
        count += block.block_hash is not None
        block = block.next_free_block
    return count


def replay_through_pool(
    pool: Any,
    trace: Trace,
    plan: list[ReplayStep],
    token_ids: list[Sequence[int]],
    hash_prefix: Callable[[Sequence[int]], list[bytes]] | None,
    hashes: list[list[bytes]] | None = None,
    count_evictions: bool = False,
) -> ReplayResult:
    """Run the replay rule of `replay_plan` through `pool`.

    Args:
        token_ids: each request's tokens, in the container its hasher reads fastest.
        hash_prefix: hashes every full block of a token sequence; None to use `hashes`.
        hashes: precomputed block hashes per request, to time the pool alone.
    """
    block_size = trace.config.block_size
    running: deque[tuple[ReplayRequest, list, ReplayStep]] = deque()
    num_hit_blocks = num_evicted = 0
    for idx, step in enumerate(plan):
        tokens = token_ids[idx]
        block_hashes = hash_prefix(tokens) if hashes is None else hashes[idx]
        request = ReplayRequest(trace.requests[idx].req_id, block_hashes, tokens)
        hits = _lookup(pool, block_hashes, step.max_hit_blocks)
        num_new = step.num_blocks - len(hits)
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        while pool.get_num_free_blocks() - num_free_hits < num_new:
            _finish_oldest(pool, running, block_size)
            num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        pool.touch(hits)
        if count_evictions:
            num_evicted += _num_hashed_at_head(pool, num_new)
        blocks = hits + pool.get_new_blocks(num_new)
        pool.cache_full_blocks(
            request, blocks, len(hits), step.num_prompt_full_blocks, block_size, 0
        )
        running.append((request, blocks, step))
        num_hit_blocks += len(hits)
        if len(running) > trace.config.max_running:
            _finish_oldest(pool, running, block_size)
    while running:
        _finish_oldest(pool, running, block_size)
    return ReplayResult(num_hit_blocks, num_evicted)


def _lookup(pool: Any, block_hashes: list[bytes], max_hit_blocks: int) -> list:
    """The longest cached prefix, left to right, stopping at the first miss."""
    hits = []
    for block_hash in block_hashes[:max_hit_blocks]:
        cached = pool.get_cached_block(block_hash, GROUP_IDS)
        if cached is None:
            break
        hits.append(cached[0])
    return hits


def _finish_oldest(pool: Any, running: deque, block_size: int) -> None:
    """Cache the oldest request's remaining full blocks, then free its blocks tail first."""
    request, blocks, step = running.popleft()
    pool.cache_full_blocks(
        request, blocks, step.num_prompt_full_blocks, step.num_full_blocks, block_size, 0
    )
    pool.free_blocks(reversed(blocks))


def prompt_hit_rate(trace: Trace, result: ReplayResult) -> float:
    """Prompt tokens served from the prefix cache, over all prompt tokens."""
    num_prompt_tokens = sum(trace.prompt_len(request) for request in trace.requests)
    return result.num_hit_blocks * trace.config.block_size / num_prompt_tokens
