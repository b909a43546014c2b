"""tiny-mla's paged tokens equal its unpaged reference: block sizes 16 and 32, prefix caching on
and off, chunked prefill, preemption with recompute; its latent is read through the block table;
its TP shards tile the full weights and all-reduce to exactly the TP=1 logits.
"""

import functools
import random
import threading

import pytest
import torch

from bench.workload import Workload, build_rank, run_to_completion, run_workload
from protocol.sampling import SamplingParams
from tests.conftest import worker_test_device
from worker.distributed import TPGroup, single_rank_group
from worker.latent_attention import DenseLatentKV
from worker.models.reference import reference_generate
from worker.models.tiny_mla import TINY_MLA, TinyMLA

DEVICE = torch.device(worker_test_device())
MODEL = TINY_MLA.name
BARRIER_TIMEOUT_S = 60.0  # the longest one simulated rank waits for the other at an all-reduce
PARAMS = [
    SamplingParams(max_tokens=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.3, ignore_eos=True),  # unseeded: handle-derived
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 10..90 tokens; most share a 70-token prefix so prefix caching hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(70)]
    prompts = []
    for i in range(count):
        head = shared[: rng.randrange(10, 70)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(4, 25))])
    return prompts


PROMPTS = make_prompts(seed=3, count=6)


@functools.cache
def reference(prompt_idx: int) -> list[int]:
    params = PARAMS[prompt_idx % len(PARAMS)]
    return reference_generate(MODEL, PROMPTS[prompt_idx], params, handle=prompt_idx + 1)


def workload(block_size: int, num_blocks: int, **options: object) -> Workload:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    return Workload(
        MODEL, block_size, num_blocks, PROMPTS, params, check_invariants=True, **options
    )


def assert_matches_reference(outputs: dict[int, list[int]]) -> None:
    for i in range(len(PROMPTS)):
        assert outputs[i + 1] == reference(i), f"request {i + 1}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_paged_tokens_equal_reference(block_size: int, enable_prefix_caching: bool) -> None:
    work = workload(
        block_size,
        1 + 4 * 128 // block_size,  # room for several requests at once
        max_num_batched_tokens=24,  # every prompt longer than 24 tokens is chunked
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    assert_matches_reference(result.outputs)
    assert (result.num_hit_tokens > 0) == enable_prefix_caching
    assert max(len(p) for p in PROMPTS) > 24


# Pools too small for the batch, yet each holding the longest request (79 + 8 tokens) alone.
TIGHT_NUM_BLOCKS = {16: 9, 32: 4}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tokens_survive_preemption_and_resumption(
    block_size: int, enable_prefix_caching: bool
) -> None:
    """The last running request is preempted, later resumed with fresh blocks, and recomputes
    its latents: a resumed table read at stale slots would change the tokens."""
    work = workload(
        block_size,
        TIGHT_NUM_BLOCKS[block_size],
        max_num_batched_tokens=32,
        enable_prefix_caching=enable_prefix_caching,
    )
    result = run_workload(work, single_rank_group(), DEVICE)
    assert result.num_preemptions > 0
    assert_matches_reference(result.outputs)


def test_float64_latents_give_the_same_tokens() -> None:
    result = run_workload(workload(16, 40, dtype="float64"), single_rank_group(), DEVICE)
    assert_matches_reference(result.outputs)


def test_a_corrupted_block_table_entry_changes_the_tokens() -> None:
    """Proves the model reads its latents through the block table: one wrong entry, other tokens."""
    prompts = [PROMPTS[0], PROMPTS[3]]  # 8 tokens (blocks 0 and 1 of 4 tokens), then 9 tokens
    work = Workload(MODEL, 4, 80, prompts, [PARAMS[0]] * 2, 200, check_invariants=True)
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    first_step = core.step()  # both prefills, each with its first token
    tokens = [
        token_id
        for client_outputs in first_step.values()
        for output in client_outputs.outputs
        if output.req_id == "1"
        for token_id in output.new_token_ids
    ]
    input_batch = executor.runner.input_batch
    table = input_batch.block_table[0]
    row, other = input_batch.handle_to_row[1], input_batch.handle_to_row[2]
    table.block_table[row, 1] = table.block_table[other, 1]  # positions 4..7 read the other's
    outputs = run_to_completion(core)
    expected = reference_generate(MODEL, prompts[0], PARAMS[0], handle=1)
    assert tokens == expected[:1] and tokens + outputs[1] != expected


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rank_shards_partition_the_heads_and_replicate_the_latent(tp_size: int) -> None:
    """Each rank keeps its heads' query, up-projection and output slices; the projections that
    make the latent are whole on every rank, so every rank caches the same latent."""
    full = TinyMLA(TINY_MLA, single_rank_group(), 0, DEVICE)
    placeholder = object()  # a process group is never used: no forward runs here
    shards = [
        TinyMLA(TINY_MLA, TPGroup(r, tp_size, placeholder), 0, DEVICE) for r in range(tp_size)
    ]
    for shard in shards:
        shard.check_invariants()
    for layer_idx, layer in enumerate(full.layers):
        parts = [shard.layers[layer_idx] for shard in shards]
        for name in ("wq", "w_k_up", "w_v_up", "w_gate", "w_up"):
            joined = torch.cat([getattr(p, name) for p in parts], dim=1)
            assert torch.equal(joined, getattr(layer, name)), f"layer {layer_idx} {name}"
        for name in ("wo", "w_down"):
            joined = torch.cat([getattr(p, name) for p in parts], dim=0)
            assert torch.equal(joined, getattr(layer, name)), f"layer {layer_idx} {name}"
        for part in parts:
            for name in ("attn_norm", "w_kv_down", "kv_norm", "w_k_rotary", "mlp_norm"):
                assert torch.equal(getattr(part, name), getattr(layer, name)), name


class ThreadedTPGroup(TPGroup):
    """Ranks as threads of one process: all_reduce sums every rank's tensor at a barrier."""

    def __init__(self, rank: int, tp_size: int, slots: list, barrier: threading.Barrier) -> None:
        super().__init__(rank, tp_size, process_group=object())
        self.slots = slots
        self.barrier = barrier

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = tensor
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0])
        self.barrier.wait()  # nobody overwrites a slot before every rank has summed
        return total


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_all_reduce_to_exactly_the_tp1_logits(tp_size: int) -> None:
    """Every rank computes the same latent and its own heads; the all-reduced logits of every
    position are bit-identical to one rank's."""
    sequence = PROMPTS[1]
    tokens = torch.tensor(sequence, dtype=torch.int64)
    positions = torch.arange(len(sequence), dtype=torch.int64)
    every = torch.arange(len(sequence))
    full = TinyMLA(TINY_MLA, single_rank_group(), 0, DEVICE)
    expected = full.forward_latent(tokens, positions, every, DenseLatentKV(len(sequence)))
    slots: list = [None] * tp_size
    barrier = threading.Barrier(tp_size, timeout=BARRIER_TIMEOUT_S)
    results: list = [None] * tp_size

    def run_rank(rank: int) -> None:
        group = ThreadedTPGroup(rank, tp_size, slots, barrier)
        model = TinyMLA(TINY_MLA, group, 0, DEVICE)
        kv = DenseLatentKV(len(sequence))
        results[rank] = (model.forward_latent(tokens, positions, every, kv), kv.store)

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BARRIER_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    for logits, latents in results:
        assert torch.equal(logits, expected)
        assert all(torch.equal(latents[name], results[0][1][name]) for name in latents)
