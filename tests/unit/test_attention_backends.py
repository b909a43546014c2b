"""The attention backends against the reference: on random schedules of decodes and prefill chunks
over scattered blocks, full-attention and sliding-window groups (one with padded pages), every
backend writes the same cache and attends as the reference's token-by-token gather does."""

import random

import numpy as np
import pytest
import torch

from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
)
from worker.attention import PagedKV, StepLayout
from worker.attention_backends.backend import resolve_attention_backend
from worker.attention_backends.block_gather import BlockGatherAttention
from worker.attention_backends.native_build import load_native
from worker.attention_backends.native_cpu import NativeCPUAttention
from worker.attention_backends.reference import ReferenceAttention
from worker.block_table import MultiGroupBlockTable
from worker.kv_cache import allocate_kv_caches

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 64
WINDOW = 6
HEAD_DIM = 8
NUM_HEADS = 4  # query heads; two per KV head
MAX_MODEL_LEN = 40
# The sliding group has half the full group's KV heads, so its pages are padded in the shared
# tensors.
GROUPS = [
    KVCacheGroupSpec(["full.0"], FullAttentionSpec(BLOCK_SIZE, 2, HEAD_DIM, "float32")),
    KVCacheGroupSpec(["slide.0"], SlidingWindowSpec(BLOCK_SIZE, 1, HEAD_DIM, "float32", WINDOW)),
]


def _schedule(seed: int) -> tuple[StepLayout, MultiGroupBlockTable]:
    """3-6 requests, each with some computed context and 1 (a decode) to 9 scheduled tokens, on
    blocks drawn at random; blocks wholly before the sliding window are the null block, as the
    engine leaves them."""
    rng = random.Random(seed)
    num_reqs = rng.randint(3, 6)
    computed = [rng.randint(0, 24) for _ in range(num_reqs)]
    scheduled = [1 if rng.random() < 0.5 else rng.randint(2, 9) for _ in range(num_reqs)]
    tables = MultiGroupBlockTable(num_reqs, MAX_MODEL_LEN, [BLOCK_SIZE, BLOCK_SIZE])
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    for row in range(num_reqs):
        num_blocks = cdiv(computed[row] + scheduled[row], BLOCK_SIZE)
        full_ids = [free.pop() for _ in range(num_blocks)]
        first_read = max(0, computed[row] - WINDOW + 1) // BLOCK_SIZE
        slide_ids = [NULL_BLOCK_ID if i < first_read else free.pop() for i in range(num_blocks)]
        tables.add_row((full_ids, slide_ids), row)
    rows = np.arange(num_reqs)
    counts = np.array(scheduled)
    ends = np.array(computed) + counts
    sampled = np.array([i for i in range(num_reqs) if rng.random() < 0.8] or [0])
    layout = StepLayout(
        rows=rows,
        first_positions=np.array(computed),
        num_queries=counts,
        token_offsets=np.cumsum(counts) - counts,
        logits_reqs=sampled,
        num_prompt_tokens=ends,
    )
    return layout, tables


def _run(backend, seed: int, dtype: torch.dtype, logits_only: bool) -> dict[str, torch.Tensor]:
    """Fill the cache with old context, write the step's K/V, attend every layer."""
    layout, tables = _schedule(seed)
    config = KVCacheConfig(NUM_BLOCKS, GROUPS)
    kv_caches = allocate_kv_caches(config, 1, CPU)
    generator = torch.Generator().manual_seed(seed)
    for cache in kv_caches.values():  # the shared tensors: every page holds old context
        cache.copy_(torch.randn(cache.shape, generator=generator))
        cache[NULL_BLOCK_ID] = 0
    kv_caches = {name: cache.to(dtype) for name, cache in kv_caches.items()}
    paged = PagedKV(kv_caches, config, tables, layout, CPU)
    attention = backend(paged)
    num_tokens = int(layout.num_queries.sum())
    results = {}
    for group in GROUPS:
        name, num_kv_heads = group.layer_names[0], group.spec.num_kv_heads
        heads = NUM_HEADS * num_kv_heads // 2
        k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
        q = torch.randn(num_tokens, heads, HEAD_DIM, generator=generator).to(dtype)
        attention.write(name, k, v)
        results[name] = attention.attend(name, q, HEAD_DIM**-0.5, logits_only)
        results[f"{name}.cache"] = kv_caches[name]
    if logits_only:  # only the sampled requests' last tokens are defined
        last = layout.token_offsets[layout.logits_reqs] + layout.num_queries[layout.logits_reqs] - 1
        for group in GROUPS:
            name = group.layer_names[0]
            results[name] = results[name][torch.from_numpy(last)]
    return results


@pytest.mark.parametrize("logits_only", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_block_gather_attends_as_the_reference(seed: int, logits_only: bool) -> None:
    ours = _run(BlockGatherAttention, seed, torch.float32, logits_only)
    theirs = _run(ReferenceAttention, seed, torch.float32, logits_only)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("seed", range(3))
def test_block_gather_in_bfloat16_stays_close_to_the_reference(seed: int) -> None:
    """bf16 queries and cache are attended in float32 on the CPU, then cast back."""
    ours = _run(BlockGatherAttention, seed, torch.bfloat16, False)
    theirs = _run(ReferenceAttention, seed, torch.bfloat16, False)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.bfloat16
        torch.testing.assert_close(ours[name], tensor, rtol=2e-2, atol=2e-2, msg=name)


def test_softcapped_scores_attend_as_the_formula() -> None:
    """With a soft-cap both backends cap the scores before the mask, as Gemma 2 does."""
    capped = {}
    for backend in (BlockGatherAttention, ReferenceAttention):
        layout, tables = _schedule(1)
        config = KVCacheConfig(NUM_BLOCKS, GROUPS)
        kv_caches = allocate_kv_caches(config, 1, CPU)
        paged = PagedKV(kv_caches, config, tables, layout, CPU)
        attention = backend(paged)
        generator = torch.Generator().manual_seed(0)
        num_tokens = int(layout.num_queries.sum())
        k = torch.randn(num_tokens, 2, HEAD_DIM, generator=generator) * 4
        q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator) * 4
        attention.write("full.0", k, k)
        capped[backend] = attention.attend("full.0", q, 1.0, False, softcap=5.0)
        plain = attention.attend("full.0", q, 1.0, False)
    torch.testing.assert_close(capped[BlockGatherAttention], capped[ReferenceAttention])
    assert not torch.allclose(capped[ReferenceAttention], plain), "the cap changed nothing"


def test_a_fresh_prompt_attends_causally_as_the_reference() -> None:
    """A prompt's first chunk under full attention is SDPA's own causal case (it then skips the
    hidden half); the same prompt in a 6-token window is not, and keeps its mask. Both attend
    as the reference does."""
    tables = MultiGroupBlockTable(2, MAX_MODEL_LEN, [BLOCK_SIZE, BLOCK_SIZE])
    tables.add_row(([1, 2, 3], [4, 5, 6]), 0)
    tables.add_row(([7, 8], [9, 10]), 1)
    layout = StepLayout(
        rows=np.array([0, 1]),
        first_positions=np.array([0, 0]),
        num_queries=np.array([9, 6]),
        token_offsets=np.array([0, 9]),
        logits_reqs=np.array([0, 1]),
        num_prompt_tokens=np.array([9, 6]),
    )
    config = KVCacheConfig(NUM_BLOCKS, GROUPS)
    generator = torch.Generator().manual_seed(3)
    results = {}
    for backend in (BlockGatherAttention, ReferenceAttention):
        paged = PagedKV(allocate_kv_caches(config, 1, CPU), config, tables, layout, CPU)
        attention = backend(paged)
        generator.manual_seed(3)
        for group in GROUPS:
            name, num_kv_heads = group.layer_names[0], group.spec.num_kv_heads
            k = torch.randn(15, num_kv_heads, HEAD_DIM, generator=generator)
            q = torch.randn(15, NUM_HEADS * num_kv_heads // 2, HEAD_DIM, generator=generator)
            attention.write(name, k, -k)
            results[backend, name] = attention.attend(name, q, HEAD_DIM**-0.5, False)
        if backend is BlockGatherAttention:
            full, slide = (attention._group_chunks(group, False) for group in (0, 1))
            assert [chunk.is_causal for chunk in full] == [True, True]
            assert [chunk.is_causal for chunk in slide] == [False, True]  # 9 > window of 6
    for name in ("full.0", "slide.0"):
        torch.testing.assert_close(
            results[BlockGatherAttention, name], results[ReferenceAttention, name]
        )


def test_a_read_of_the_null_block_is_refused() -> None:
    """Guards against attending to a block the engine freed: a window's block replaced by the
    null block while a query still reads it is an error, not zeros."""
    tables = MultiGroupBlockTable(1, MAX_MODEL_LEN, [BLOCK_SIZE, BLOCK_SIZE])
    # a decode at position 9 reads positions 4-9 in its window: blocks 1 and 2 of its table
    tables.add_row(([1, 2, 3], [4, NULL_BLOCK_ID, 6]), 0)
    layout = StepLayout(
        rows=np.array([0]),
        first_positions=np.array([9]),
        num_queries=np.array([1]),
        token_offsets=np.array([0]),
        logits_reqs=np.array([0]),
        num_prompt_tokens=np.array([9]),
    )
    config = KVCacheConfig(NUM_BLOCKS, GROUPS)
    paged = PagedKV(allocate_kv_caches(config, 1, CPU), config, tables, layout, CPU)
    q = torch.zeros(1, NUM_HEADS // 2, HEAD_DIM)
    with pytest.raises(ValueError, match="row 0 reads block 1 of its table"):
        BlockGatherAttention(paged).attend("slide.0", q, 1.0, False)


def test_unknown_and_misplaced_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="attention backend 'flash'"):
        resolve_attention_backend("flash", CPU)
    with pytest.raises(ValueError, match="'triton' runs on CUDA devices only"):
        resolve_attention_backend("triton", CPU)
    assert resolve_attention_backend("auto", CPU) is NativeCPUAttention
    assert resolve_attention_backend("blocks", CPU) is BlockGatherAttention
    assert resolve_attention_backend("reference", CPU) is ReferenceAttention
    from worker.attention_backends.triton_backend import TritonBackend

    assert resolve_attention_backend("triton", torch.device("cuda", 0)) is TritonBackend


@pytest.mark.parametrize("logits_only", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_the_native_kernel_attends_as_the_reference(seed: int, logits_only: bool) -> None:
    """Decode rows go through the compiled kernel (reading the padded sliding pages in place),
    prompt chunks through `blocks`: together, the reference's attention."""
    assert load_native() is not None, "the host's C++ compiler must build the kernel"
    ours = _run(NativeCPUAttention, seed, torch.float32, logits_only)
    theirs = _run(ReferenceAttention, seed, torch.float32, logits_only)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("seed", range(3))
def test_the_native_kernel_reads_bfloat16_pages_as_blocks_does(seed: int) -> None:
    """Both widen the bf16 pages to float32 and attend in float32: equal up to summation order."""
    ours = _run(NativeCPUAttention, seed, torch.bfloat16, True)
    theirs = _run(BlockGatherAttention, seed, torch.bfloat16, True)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-2, atol=1e-2, msg=name)


def test_the_native_kernel_runs_on_decode_rows_and_soft_caps() -> None:
    """A step of decodes only: every row is the kernel's (the gather path never runs), and a
    soft cap gives the reference's capped attention."""
    seed = 11
    layout, tables = _schedule(seed)
    decodes = StepLayout(
        rows=layout.rows,
        first_positions=layout.first_positions + layout.num_queries - 1,
        num_queries=np.ones_like(layout.num_queries),
        token_offsets=np.arange(len(layout.rows)),
        logits_reqs=np.arange(len(layout.rows)),
        num_prompt_tokens=layout.num_prompt_tokens,
    )
    config = KVCacheConfig(NUM_BLOCKS, GROUPS)
    outputs = []
    for backend in (NativeCPUAttention, ReferenceAttention):
        generator = torch.Generator().manual_seed(seed)
        kv_caches = allocate_kv_caches(config, 1, CPU)
        for cache in kv_caches.values():
            cache.copy_(torch.randn(cache.shape, generator=generator))
        attention = backend(PagedKV(kv_caches, config, tables, decodes, CPU))
        if backend is NativeCPUAttention:
            attention._gather = None  # type: ignore[method-assign]  # must never gather
        q = torch.randn(len(decodes.rows), NUM_HEADS, HEAD_DIM, generator=generator)
        outputs.append(attention.attend("full.0", q, HEAD_DIM**-0.5, False, softcap=0.5))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "dtype"),
    [
        (64, 16, torch.float32),
        (64, 16, torch.bfloat16),
        (128, 32, torch.float16),
        (64, 64, torch.float8_e4m3fn),
        (80, 16, torch.bfloat16),
    ],
)
def test_the_native_kernel_at_served_head_sizes_attends_as_blocks(
    head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    """The kernel compiles head sizes 64 and 128 in and splits blocks past 16 tokens into
    tiles; the other tests' head size of 8 takes its run-time path. Decodes of 1-90 tokens of
    context over shuffled blocks, 3 query heads per KV head (a partial head tile), in every
    cache dtype it reads, with q and out in a half cache's dtype: `blocks` widens the same
    pages and attends in float32."""
    rng = random.Random(head_dim + block_size)
    contexts = [rng.randint(0, 90) for _ in range(5)]
    num_blocks = 1 + sum(cdiv(n + 1, block_size) for n in contexts)
    group = KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size, 2, head_dim, "float32"))
    config = KVCacheConfig(num_blocks, [group])
    tables = MultiGroupBlockTable(len(contexts), 128, [block_size])
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for row, context in enumerate(contexts):
        tables.add_row(([free.pop() for _ in range(cdiv(context + 1, block_size))],), row)
    layout = StepLayout(
        rows=np.arange(len(contexts)),
        first_positions=np.array(contexts),
        num_queries=np.ones(len(contexts), dtype=np.int64),
        token_offsets=np.arange(len(contexts)),
        logits_reqs=np.arange(len(contexts)),
        num_prompt_tokens=np.array(contexts) + 1,
    )
    generator = torch.Generator().manual_seed(head_dim)
    cache = allocate_kv_caches(config, 1, CPU)["full.0"]
    kv_caches = {"full.0": torch.randn(cache.shape, generator=generator).to(dtype)}
    is_half = dtype in (torch.bfloat16, torch.float16)  # a model in the cache's dtype
    q = torch.randn(len(contexts), 6, head_dim, generator=generator).to(
        dtype if is_half else torch.float32
    )
    paged = PagedKV(kv_caches, config, tables, layout, CPU)
    native = NativeCPUAttention(paged)
    native._gather = None  # type: ignore[method-assign]  # every row is the kernel's
    ours = native.attend("full.0", q, head_dim**-0.5, False)
    theirs = BlockGatherAttention(paged).attend("full.0", q, head_dim**-0.5, False)
    tolerance = 1e-2 if is_half else 1e-5  # both round float32 to q's dtype: an ulp apart
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
