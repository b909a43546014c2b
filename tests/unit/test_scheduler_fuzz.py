"""Seeded fuzz of the step loop: random arrivals, lengths, priorities and aborts in a small pool.

The FakeExecutor checks every SchedulerOutput (sums, budgets, new and finished ids, computed
counts); after every step this test checks the prefill threshold, max_num_seqs and the workers'
block tables against the KV-cache manager's, and at the end every request's tokens, and the
logprobs of every third request, one entry per delivered token.
"""

import random

import pytest
from fake_executor import Harness, fake_logprobs, reference_tokens

NUM_STEPS = 10_000
BASE_PROMPTS = 4  # requests share prefixes of these, so prefix hits happen


def _random_prompt(rng: random.Random, bases: list[list[int]], vocab_size: int) -> list[int]:
    base = rng.choice(bases)[: rng.randrange(0, 24)]
    return base + [
        rng.randrange(vocab_size) for _ in range(rng.randrange(1 if not base else 0, 12))
    ]


def _num_logprobs(req_idx: int) -> int | None:
    """Every third request asks for 0, 1 or 2 alternatives (no draw: the workload stays)."""
    return None if req_idx % 3 else req_idx % 9 // 3


def _check_tokens(harness: Harness, prompts: dict[str, list[int]]) -> None:
    for req_idx, (req_id, prompt) in enumerate(prompts.items()):
        produced = harness.tokens[req_id]
        assert produced == reference_tokens(prompt, len(produced), harness.vocab_size), req_id
        num_logprobs = _num_logprobs(req_idx)
        expected = [
            fake_logprobs(token_id, len(prompt) + idx, num_logprobs, harness.vocab_size)
            for idx, token_id in enumerate(produced)
            if num_logprobs is not None
        ]
        assert harness.logprobs.get(req_id, []) == expected, req_id


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("policy", "seed"), [("fcfs", 1), ("priority", 2)])
def test_random_workload_keeps_every_step_consistent(
    policy: str, seed: int, async_scheduling: bool
) -> None:
    """With asynchronous scheduling too: every request's tokens are the reference's, through
    aborts mid-stream, preemption and prefix hits, and nothing leaks."""
    rng = random.Random(seed)
    harness = Harness(
        num_blocks=24,
        block_size=4,
        vocab_size=64,
        eos_token_ids=[0],
        max_model_len=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        long_prefill_token_threshold=12,
        scheduling_policy=policy,
        async_scheduling=async_scheduling,
    )
    bases = [[rng.randrange(64) for _ in range(24)] for _ in range(BASE_PROMPTS)]
    prompts: dict[str, list[int]] = {}
    num_steps = NUM_STEPS
    for step_idx in range(num_steps):
        if rng.random() < 0.3 and len(harness.scheduler.requests) < 24:
            req_id = f"r{len(prompts)}"
            prompts[req_id] = _random_prompt(rng, bases, 64)
            rejection = harness.add(
                req_id,
                prompts[req_id],
                priority=rng.randrange(3),
                arrival_time=float(step_idx),
                max_tokens=rng.randrange(1, 30),
                ignore_eos=rng.random() < 0.5,
                logprobs=_num_logprobs(len(prompts) - 1),
            )
            assert rejection is None
        if rng.random() < 0.02 and harness.scheduler.requests:
            harness.abort([rng.choice(list(harness.scheduler.requests))])
        harness.step()
        harness.check_worker_tables()
        harness.check_last_step_budget(max_tokens_per_request=12, max_num_seqs=8)
    harness.check_no_leaks()
    _check_tokens(harness, prompts)
    assert harness.executor.num_steps >= num_steps
    assert harness.scheduler.num_preemptions > 50, "the pool should force frequent preemption"
    assert sum(harness.num_cached_tokens.values()) > 0, "shared prefixes should hit the cache"
