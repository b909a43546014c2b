"""PagedKV's row view of the cache: writes and gathers land exactly where indexing the
five-dimensional cache [num_blocks, 2, block_size, heads, head_dim] by (block, K or V, offset)
would put them, also for a group whose pages the shared tensor pads to a larger group's."""

import numpy as np
import pytest
import torch

from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from worker.attention import PagedKV, StepLayout
from worker.block_table import MultiGroupBlockTable
from worker.kv_cache import allocate_kv_caches

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 12
# Group 1's page is half of group 0's, so its layers view the shared tensors with padded blocks.
GROUPS = [
    KVCacheGroupSpec(["wide.0", "wide.1"], FullAttentionSpec(BLOCK_SIZE, 4, 2, "int64")),
    KVCacheGroupSpec(["narrow.0", "narrow.1"], FullAttentionSpec(BLOCK_SIZE, 2, 2, "int64")),
]
# Per group, each request's blocks; a block id belongs to one group at a time.
BLOCK_IDS = [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10])]  # request 0, request 1
NUM_TOKENS = [9, 6]  # each request's whole prefill, in one step


def _paged_kv(kv_caches: dict[str, torch.Tensor]) -> PagedKV:
    tables = MultiGroupBlockTable(2, 16, [BLOCK_SIZE, BLOCK_SIZE])
    for row, block_ids in enumerate(BLOCK_IDS):
        tables.add_row(block_ids, row)
    layout = StepLayout(
        rows=np.array([0, 1]),
        first_positions=np.array([0, 0]),
        num_queries=np.array(NUM_TOKENS),
        token_offsets=np.array([0, NUM_TOKENS[0]]),
        logits_reqs=np.array([0, 1]),
        num_prompt_tokens=np.array(NUM_TOKENS),
    )
    return PagedKV(kv_caches, KVCacheConfig(NUM_BLOCKS, GROUPS), tables, layout, CPU)


@pytest.mark.parametrize("layer_name", ["wide.1", "narrow.0"])
def test_writes_and_gathers_address_the_cache_by_block_kind_and_offset(layer_name: str) -> None:
    kv_caches = allocate_kv_caches(KVCacheConfig(NUM_BLOCKS, GROUPS), 1, CPU)
    cache = kv_caches[layer_name]
    group_idx = 0 if layer_name.startswith("wide") else 1
    if group_idx == 1:
        assert cache.stride(0) > cache[0].numel(), "the narrow group's blocks are padded"
    num_tokens, heads, head_dim = sum(NUM_TOKENS), cache.shape[3], cache.shape[4]
    k = torch.arange(num_tokens * heads * head_dim).view(num_tokens, heads, head_dim) + 1
    v = -k
    paged = _paged_kv(kv_caches)
    paged.write(layer_name, k, v)
    token = 0
    for req_idx, count in enumerate(NUM_TOKENS):
        block_ids = BLOCK_IDS[req_idx][group_idx]
        for position in range(count):
            block, offset = block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            assert torch.equal(cache[block, 0, offset], k[token]), (req_idx, position)
            assert torch.equal(cache[block, 1, offset], v[token]), (req_idx, position)
            token += 1
    written = sum(NUM_TOKENS) * 2 * heads * head_dim
    assert int((cache != 0).sum()) == written, "nothing but the tokens' slots was written"
    for other_name, other in kv_caches.items():
        if other_name != layer_name and other.untyped_storage().data_ptr() != (
            cache.untyped_storage().data_ptr()
        ):
            assert int((other != 0).sum()) == 0, f"{other_name} was written"
    for chunk in paged.chunks(layer_name):
        k_ctx, v_ctx = paged.gather(layer_name, chunk)
        assert torch.equal(k_ctx, cache[chunk.block_idx, 0, chunk.block_offsets])
        assert torch.equal(v_ctx, cache[chunk.block_idx, 1, chunk.block_offsets])


def test_a_cache_whose_blocks_are_not_contiguous_inside_is_refused() -> None:
    kv_caches = allocate_kv_caches(KVCacheConfig(NUM_BLOCKS, GROUPS), 1, CPU)
    kv_caches["wide.0"] = kv_caches["wide.0"].transpose(3, 4)
    paged = _paged_kv(kv_caches)
    k = torch.zeros(sum(NUM_TOKENS), 2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"wide\.0's KV cache has strides"):
        paged.write("wide.0", k, k)
