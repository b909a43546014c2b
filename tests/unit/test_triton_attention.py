"""The Triton kernels, run by triton's interpreter on the CPU, write the cache exactly as PagedKV
does and attend as the reference backend's gather + SDPA path (worker/attention_backends/
reference.py) does, for one step that mixes decode rows and prefill chunks over contexts in
scattered blocks, in float32 and bfloat16.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: @triton.jit decides there

import numpy as np
import pytest
import torch

from protocol.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from worker.attention import PagedKV, StepLayout
from worker.attention_backends.reference import paged_attention
from worker.attention_backends.triton_backend import TritonBackend
from worker.attention_backends.triton_kernels import store_kv
from worker.block_table import MultiGroupBlockTable
from worker.kv_cache import allocate_kv_caches

CPU = torch.device("cpu")
NUM_BLOCKS = 64  # 48 blocks of 4 tokens for both groups, and spares
WINDOW = 5
# The step's requests: (batch row, positions already cached, positions scheduled now). Row 2 and
# row 1 decode, row 0 continues its prompt in a chunk that does not reach its end (not sampled),
# row 3 prefills 40 tokens: more queries than one program's tile and positions than one key tile.
REQUESTS = [(2, 13, 1), (0, 6, 7), (3, 0, 40), (1, 20, 1)]
SAMPLED = [0, 2, 3]  # indices into REQUESTS of the requests whose chunk reaches their end
# Two KV heads each; 4 query heads over "full.0" (groups of 2) and 6 over "window.0" (of 3).
NUM_HEADS = {"full.0": 4, "window.0": 6}


def _groups(block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
    """A full-attention group and a sliding-window one whose smaller pages the shared tensor pads
    to the full group's, so its cache's block stride exceeds one of its blocks."""
    return [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size, 2, 32, dtype)),
        KVCacheGroupSpec(["window.0"], SlidingWindowSpec(block_size, 2, 16, dtype, WINDOW)),
    ]


def _step(groups: list[KVCacheGroupSpec], seed: int) -> PagedKV:
    """One step's PagedKV over freshly allocated caches full of random values (never-written
    positions included, so that reading one changes the result); the block ids of every request
    are scattered over the pool."""
    config = KVCacheConfig(NUM_BLOCKS, groups)
    kv_caches = allocate_kv_caches(config, 1, CPU)
    generator = torch.Generator().manual_seed(seed)
    for cache in kv_caches.values():
        cache.copy_(torch.randn(cache.shape, generator=generator))
    block_size = groups[0].spec.block_size
    tables = MultiGroupBlockTable(4, 64, [block_size] * len(groups))
    free_ids = iter(np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS)).tolist())
    for row, cached, scheduled in REQUESTS:
        num_blocks = cdiv(cached + scheduled, block_size)
        block_ids = tuple([next(free_ids) for _ in range(num_blocks)] for _ in groups)
        tables.add_row(block_ids, row)
    rows, first, counts = (np.array(column) for column in zip(*REQUESTS, strict=True))
    layout = StepLayout(
        rows=rows,
        first_positions=first,
        num_queries=counts,
        token_offsets=np.cumsum(counts) - counts,
        logits_reqs=np.array(SAMPLED),
        num_prompt_tokens=first + counts,
    )
    return PagedKV(kv_caches, config, tables, layout, CPU)


def _qkv(
    layer_name: str, kv: PagedKV, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [T, H, head_dim] and k, v [T, num_kv_heads, head_dim] of the step's tokens."""
    _, _, _, num_kv_heads, head_dim = kv.kv_caches[layer_name].shape
    num_tokens = sum(scheduled for _, _, scheduled in REQUESTS)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_HEADS[layer_name], head_dim, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("logits_only", [False, True], ids=["all_tokens", "logits_only"])
@pytest.mark.parametrize(
    ("block_size", "dtype"),
    [(4, torch.float32), (16, torch.float32), (4, torch.bfloat16)],
    ids=["block4-float32", "block16-float32", "block4-bfloat16"],
)
@pytest.mark.parametrize("layer_name", ["full.0", "window.0"])
def test_kernels_write_and_attend_as_the_gather_path(
    layer_name: str, block_size: int, dtype: torch.dtype, logits_only: bool
) -> None:
    groups = _groups(block_size, str(dtype).removeprefix("torch."))
    reference, under_test = _step(groups, seed=1), _step(groups, seed=1)
    q, k, v = _qkv(layer_name, reference, dtype, seed=2)
    scale = q.shape[-1] ** -0.5
    reference.write(layer_name, k, v)
    expected = paged_attention(reference, layer_name, q, scale, logits_only)
    backend = TritonBackend(under_test)
    backend.write(layer_name, k, v)
    result = backend.attend(layer_name, q, scale, logits_only)
    for name, cache in reference.kv_caches.items():
        assert torch.equal(under_test.kv_caches[name], cache), name
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(result, expected, rtol=tolerance, atol=tolerance)
    if logits_only:  # guards the comparison itself: only the sampled requests' last rows are set
        assert int(expected.any(dim=1).sum()) == len(SAMPLED)


def _softcapped_reference(
    kv: PagedKV, layer_name: str, q: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention over PagedKV's gathered contexts in float32 with the scores soft-capped before
    the mask, spelled out: [T, H * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.zeros(num_tokens, num_heads * head_dim)  # [T, H * head_dim]
    for chunk in kv.chunks(layer_name):
        k_ctx, v_ctx = kv.gather(layer_name, chunk)  # each [S, L, KV, head_dim]
        group = num_heads // k_ctx.shape[2]
        keys = k_ctx.float().repeat_interleave(group, dim=2)  # [S, L, H, head_dim]
        values = v_ctx.float().repeat_interleave(group, dim=2)
        scores = torch.einsum("snhd,slhd->shnl", q[chunk.query_idx].float(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~chunk.mask[:, None], -torch.inf)  # [S, H, n, L]
        result = torch.einsum("shnl,slhd->snhd", scores.softmax(-1), values)
        out[chunk.query_idx.reshape(-1)] = result.reshape(-1, num_heads * head_dim)
    return out


@pytest.mark.parametrize("layer_name", ["full.0", "window.0"])
def test_softcap_bounds_the_scores_before_the_mask(layer_name: str) -> None:
    groups = _groups(4, "float32")
    kv = _step(groups, seed=3)
    q, k, v = _qkv(layer_name, kv, torch.float32, seed=4)
    q = q * 4  # scores well past the cap, where capping changes the weights
    scale, softcap = q.shape[-1] ** -0.5, 2.0
    kv.write(layer_name, k, v)
    uncapped = _softcapped_reference(kv, layer_name, q, scale, None)
    torch.testing.assert_close(  # the spelled-out reference is the gather path's attention
        uncapped, paged_attention(kv, layer_name, q, scale, False), rtol=1e-5, atol=1e-5
    )
    expected = _softcapped_reference(kv, layer_name, q, scale, softcap)
    assert not torch.allclose(expected, uncapped, atol=1e-2)
    result = TritonBackend(kv).attend(layer_name, q, scale, False, softcap=softcap)
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)


def test_store_kv_writes_nothing_for_a_negative_slot() -> None:
    """A padded row of a CUDA graph carries slot -1: its K/V must not land anywhere (a slot
    wrapped to the last one of the cache, or to block -1, would corrupt another request)."""
    kv_caches = allocate_kv_caches(KVCacheConfig(8, _groups(4, "float32")), 1, CPU)
    cache = kv_caches["window.0"]  # padded blocks: the block stride comes from the tensor
    assert cache.stride(0) > cache[0].numel()
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(5)))
    expected = cache.clone()  # [8, 2, 4, 2, 16], contiguous
    slots = [9, -1, 4 * 7 + 3, 4]  # block 2 offset 1, padding, the last slot, block 1 offset 0
    k = torch.randn(len(slots), 2, 16, generator=torch.Generator().manual_seed(6))
    v = -k
    store_kv(cache, k, v, torch.tensor(slots))
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // 4, 0, slot % 4] = k[token]
            expected[slot // 4, 1, slot % 4] = v[token]
    assert torch.equal(cache, expected)


def test_backend_refuses_a_group_it_cannot_read() -> None:
    spec: KVCacheSpec = ChunkedLocalAttentionSpec(4, 2, 16, "float32", 8)
    kv = _step([KVCacheGroupSpec(["local.0"], spec)], seed=7)
    q = torch.zeros(sum(scheduled for _, _, scheduled in REQUESTS), 4, 16)  # [T, H, head_dim]
    with pytest.raises(ValueError, match="group 0 of kind ChunkedLocalAttentionSpec"):
        TritonBackend(kv).attend("local.0", q, 0.25, False)
