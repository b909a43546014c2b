"""Greedy tokens served through the engine's Scheduler and ModelRunner over the paged cache equal
transformers' generate() (float32), with prefix caching on and off, chunked prefill, a pool small
enough to preempt, asynchronous scheduling, and TP=2 (ranks as threads).

A comparison may stop at a step where transformers' top-2 logit margin is below MARGIN_TOL (as
vLLM's check_logprobs_close): there float32 rounding may pick either token. With these prompts
and seeds 1 step of the 540 is such a near-tie (margin 8.7e-4), and the served token matched it
anyway; `test_near_ties_are_rare` keeps count.
"""

import random
from pathlib import Path

import pytest
import torch
import transformers

from bench.workload import RankResult, Workload, build_rank, run_workload
from engine_core.kv_cache.single_type_manager import FullAttentionManager, SlidingWindowManager
from protocol.sampling import SamplingParams
from tests.unit.hf_checkpoints import (
    GEMMA2_ALTERNATING,
    GEMMA3_FIVE_TO_ONE,
    LLAMA3_ROPE,
    MIXTRAL,
    PHI3_ORIGINAL_LEN,
    PHI3_PARTIAL,
    QWEN3_MIXED_LAYERS,
    QWEN3_MOE,
    hf_greedy,
    write_checkpoints,
)
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import single_rank_group

MARGIN_TOL = 1e-3  # float32 logits differ by ~1e-5 from transformers', so only a near-tie flips
MAX_TOKENS = 10
CPU = torch.device("cpu")
CASES = {
    "qwen3-mixed-layers": ("qwen3", dict(QWEN3_MIXED_LAYERS, tie_word_embeddings=True)),
    "mistral-window-8": ("mistral", dict(sliding_window=8)),
    "llama-llama3": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    "qwen2-biases": ("qwen2", {}),
    "qwen3-moe": ("qwen3-moe", QWEN3_MOE),
    "mixtral": ("mixtral", MIXTRAL),
    "gemma2-alternating": ("gemma2", GEMMA2_ALTERNATING),
    "gemma3-five-to-one": ("gemma3", GEMMA3_FIVE_TO_ONE),
    "phi3-partial-longrope": ("phi3", PHI3_PARTIAL),
}


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 6 to 40 tokens; two of three share a 24-token head, so prefix caching hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    prompts = []
    for i in range(count):
        head = shared[: rng.randrange(8, 25)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 256) for _ in range(rng.randrange(6, 17))])
    return prompts


PROMPTS = make_prompts(seed=5, count=6)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
MAX_NEAR_TIES = 2  # of len(CASES) x len(PROMPTS) x MAX_TOKENS = 540 steps (1 today)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list]]:
    """Each case's folder and transformers' greedy (tokens, margins) of every prompt."""
    return {
        name: (folder, [hf_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS])
        for name, (folder, model) in write_checkpoints(tmp_path_factory, CASES, seed=1).items()
    }


def workload(folder: Path, num_blocks: int = 200, **options: object) -> Workload:
    return Workload(
        str(folder),
        4,
        num_blocks,
        PROMPTS,
        [GREEDY] * len(PROMPTS),
        check_invariants=True,
        **options,
    )


def assert_greedy_matches(case: str, result: RankResult, references: list) -> None:
    for i, (tokens, margins) in enumerate(references):
        served = result.outputs[i + 1]
        assert len(served) == MAX_TOKENS, f"{case} request {i + 1}: {len(served)} tokens"
        first_diff = next(
            (j for j, (a, b) in enumerate(zip(served, tokens, strict=True)) if a != b), None
        )
        if first_diff is None:
            continue
        assert margins[first_diff] < MARGIN_TOL, (
            f"{case} request {i + 1} differs at step {first_diff} (margin "
            f"{margins[first_diff]:.3g}): served {served}, transformers {tokens}"
        )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_tokens_equal_transformers_generate(
    checkpoints: dict, case: str, enable_prefix_caching: bool
) -> None:
    """Chunked prefill (12 tokens a step; prompts reach 40), asynchronous scheduling."""
    folder, references = checkpoints[case]
    work = workload(
        folder,
        max_num_batched_tokens=12,
        enable_prefix_caching=enable_prefix_caching,
        async_scheduling=True,
    )
    result = run_workload(work, single_rank_group(), CPU)
    assert (result.num_hit_tokens > 0) == enable_prefix_caching
    assert_greedy_matches(case, result, references)


# Pools just large enough for one request of each case (a hybrid's groups each hold blocks: its
# kinds split into groups of equal size, kv_groups.py); Gemma 3's six groups take 8-token steps,
# so that one request needs fewer blocks than two hold
HYBRID_POOLS = {
    "qwen3-mixed-layers": (32, 16),
    "gemma2-alternating": (40, 16),
    "gemma3-five-to-one": (40, 8),
}


@pytest.mark.parametrize(
    ("case", "num_blocks", "step_tokens"),
    [
        ("qwen3-mixed-layers", *HYBRID_POOLS["qwen3-mixed-layers"]),
        ("mistral-window-8", 16, 16),
        ("qwen3-moe", 20, 16),
        ("mixtral", 20, 16),
        ("gemma2-alternating", *HYBRID_POOLS["gemma2-alternating"]),
        ("gemma3-five-to-one", *HYBRID_POOLS["gemma3-five-to-one"]),
        ("phi3-partial-longrope", 16, 16),
    ],
)
def test_greedy_tokens_survive_preemption(
    checkpoints: dict, case: str, num_blocks: int, step_tokens: int
) -> None:
    folder, references = checkpoints[case]
    work = workload(folder, num_blocks, max_num_batched_tokens=step_tokens, async_scheduling=True)
    result = run_workload(work, single_rank_group(), CPU)
    assert result.num_preemptions > 0
    assert_greedy_matches(case, result, references)


@pytest.mark.parametrize(
    ("case", "num_blocks", "step_tokens", "enable_prefix_caching"),
    [
        ("qwen3-mixed-layers", *HYBRID_POOLS["qwen3-mixed-layers"], True),
        ("qwen2-biases", 200, 16, False),
        ("qwen3-moe", 20, 16, True),
        ("mixtral", 20, 16, True),
        ("gemma2-alternating", *HYBRID_POOLS["gemma2-alternating"], True),
        ("gemma3-five-to-one", *HYBRID_POOLS["gemma3-five-to-one"], True),
        ("phi3-partial-longrope", 16, 16, True),
    ],
)
def test_tp2_greedy_tokens_equal_transformers_generate(
    checkpoints: dict, case: str, num_blocks: int, step_tokens: int, enable_prefix_caching: bool
) -> None:
    """Both ranks drive their own EngineCore in lockstep; identical logits keep them there.
    The small pools preempt; qwen2 runs without prefix caching."""
    folder, references = checkpoints[case]
    work = workload(
        folder,
        num_blocks,
        max_num_batched_tokens=step_tokens,
        async_scheduling=True,
        enable_prefix_caching=enable_prefix_caching,
    )
    rank0, rank1 = run_ranks(2, lambda group: run_workload(work, group, CPU))
    assert rank0.outputs == rank1.outputs
    assert (rank0.num_hit_tokens > 0) == enable_prefix_caching
    assert num_blocks > 100 or rank0.num_preemptions > 0
    assert_greedy_matches(case, rank0, references)


def test_near_ties_are_rare(checkpoints: dict) -> None:
    """The steps where a comparison could be excused are few, so the comparisons above test
    nearly every token."""
    margins = [m for _, references in checkpoints.values() for _, ms in references for m in ms]
    assert len(margins) == len(CASES) * len(PROMPTS) * MAX_TOKENS
    near_ties = [m for m in margins if m < MARGIN_TOL]
    assert len(near_ties) <= MAX_NEAR_TIES, near_ties


def test_gemma_window_blocks_are_freed_as_the_context_passes_them(checkpoints: dict) -> None:
    """Gemma 3's five sliding layers form five groups (of one layer, as its one full layer does)
    that sliding-window managers run: once the context is a window past a block, the block goes
    back to the pool, and get_stats' kv_cache_usage counts only the blocks still held. The
    full-attention group keeps them all."""
    folder, references = checkpoints["gemma3-five-to-one"]
    prompt_idx = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))  # 28 tokens
    num_blocks, block_size, chunk = 128, 4, 12
    work = Workload(
        str(folder),
        block_size,
        num_blocks,
        [PROMPTS[prompt_idx]],
        [GREEDY],
        check_invariants=True,
        enable_prefix_caching=False,  # a freed block goes straight back to the free queue
        max_num_batched_tokens=chunk,
    )
    core, _ = build_rank(work, single_rank_group(), CPU)
    coordinator = core.scheduler.kv_cache_manager.coordinator
    full, *slidings = coordinator.single_type_managers
    assert isinstance(full, FullAttentionManager) and len(slidings) == 5
    assert all(isinstance(sliding, SlidingWindowManager) for sliding in slidings)
    window = slidings[0].sliding_window
    tokens, held = [], []  # held: per step, (full blocks, live blocks of one window, its span)
    while core.scheduler.has_unfinished_requests():
        for client_outputs in core.step().values():
            for output in client_outputs.outputs:
                tokens.extend(output.new_token_ids)
        full_blocks, *window_groups = coordinator.get_blocks("1")
        lives = [sum(not block.is_null for block in blocks) for blocks in window_groups]
        assert len(set(lives)) == 1, lives  # the five windows move together
        held.append((len(full_blocks), lives[0], len(window_groups[0])))
        usage = core.get_stats()["kv_cache_usage"]
        assert round(usage * (num_blocks - 1)) == len(full_blocks) + sum(lives), (usage, held)
    assert tokens == references[prompt_idx][0]
    full_blocks, live, span = held[-2]  # the last step finished the request and freed it all
    # the full group holds a block of every 4 tokens the request has (36 by then)
    assert span == full_blocks == (len(PROMPTS[prompt_idx]) + MAX_TOKENS - 2) // block_size
    # at most the window's blocks and a scheduled chunk's stay live; the rest went back
    assert max(live for _, live, _ in held) <= -(-(window - 1 + chunk) // block_size) + 1
    assert span - live >= span // 2, held


def test_phi3_prompts_past_the_original_context_take_the_long_factors(checkpoints: dict) -> None:
    """Prompts longer than original_max_position_embeddings (64), one sharing a prefix with
    another, in 16-token chunks: transformers prefills each in one pass with the long factors
    and decodes with them; kvserve, its max_model_len past 64, rotates every token with them
    too, so a cached prefix and every chunk agree (rope.Rotary)."""
    folder, _ = checkpoints["phi3-partial-longrope"]
    hf_model = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(11)
    head = [rng.randrange(3, 256) for _ in range(PHI3_ORIGINAL_LEN + 8)]
    prompts = [
        head + [rng.randrange(3, 256) for _ in range(5)],
        head[:-4] + [rng.randrange(3, 256) for _ in range(12)],
        [rng.randrange(3, 256) for _ in range(PHI3_ORIGINAL_LEN + 1)],
    ]
    references = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    work = Workload(
        str(folder),
        4,
        200,
        prompts,
        [GREEDY] * len(prompts),
        check_invariants=True,
        max_num_batched_tokens=16,
    )
    result = run_workload(work, single_rank_group(), CPU)
    assert result.num_hit_tokens > 0
    assert_greedy_matches("phi3-long-prompts", result, references)
