"""KV-cache groups of different block sizes over one hash_block_size (the gcd of their sizes).

Requests hash at hash_block_size; a group with larger blocks reads the hashes through
BlockHashListWithBlockSize, and every hit ends on the lcm of the block sizes.
"""

import math

import pytest
from kv_specs import full_spec, kv_cache_config, window_spec

from engine_core.kv_cache.coordinator import HybridKVCacheCoordinator, UnitaryKVCacheCoordinator
from engine_core.kv_cache.hashing import (
    BlockHash,
    BlockHasher,
    BlockHashListWithBlockSize,
    get_hash_block_size,
    make_block_hash_with_group_id,
)
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.sched.limits import resolve_limits
from engine_core.sched.request import Request
from protocol.config import CacheConfig, SchedulerConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelInfo

HASH_BLOCK_SIZE = 2


def _request(req_id: str, token_ids: list[int]) -> Request:
    hasher = BlockHasher(HASH_BLOCK_SIZE)
    return Request(req_id, token_ids, SamplingParams(), block_hasher=hasher)


def _admit(manager: KVCacheManager, request: Request) -> int:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return num_hit_tokens


def test_hash_block_size_is_the_gcd_of_the_block_sizes() -> None:
    assert get_hash_block_size([16]) == 16
    assert get_hash_block_size([16, 32]) == 16
    assert get_hash_block_size([32, 48, 16]) == 16
    assert get_hash_block_size([12, 8]) == 4
    with pytest.raises(ValueError, match="expected at least one"):
        get_hash_block_size([])


def test_view_names_each_larger_block_by_its_last_hash() -> None:
    hashes = [BlockHash(bytes([idx])) for idx in range(7)]
    view = BlockHashListWithBlockSize(hashes, 2, 6)  # 3 hash blocks per block
    assert len(view) == 2
    assert (view[0], view[1], view[-1]) == (hashes[2], hashes[5], hashes[5])
    assert view[0:2] == [hashes[2], hashes[5]]
    with pytest.raises(IndexError, match="block 2 of a view holding 2 full blocks"):
        view[2]
    snapshot = view.snapshot()
    hashes.extend([BlockHash(b"\x07"), BlockHash(b"\x08")])  # the view reads the list live
    assert len(view) == 3 and view[2] == hashes[8]
    assert snapshot == [hashes[2], hashes[5]]  # a snapshot keeps what the view held then
    for num_hashes in range(10):
        view = BlockHashListWithBlockSize(hashes[:num_hashes], 2, 6)
        assert view.snapshot() == list(view)
    with pytest.raises(ValueError, match="block_size=5 is not a multiple of hash_block_size=2"):
        BlockHashListWithBlockSize(hashes, 2, 5)


def test_view_hash_covers_the_whole_larger_block() -> None:
    """Two prompts that differ only in the first half of a larger block differ in its hash."""
    first, second = _request("a", [1, 2, 3, 4]), _request("b", [9, 2, 3, 4])
    first_view = BlockHashListWithBlockSize(first.block_hashes, 2, 4)
    second_view = BlockHashListWithBlockSize(second.block_hashes, 2, 4)
    assert first_view[0] != second_view[0]


def test_one_group_keeps_the_unitary_coordinator() -> None:
    manager = KVCacheManager(kv_cache_config(8, full_spec(4)), max_model_len=64)
    assert type(manager.coordinator) is UnitaryKVCacheCoordinator


def test_hit_ends_on_the_lcm_of_the_block_sizes() -> None:
    """Full attention (blocks of 2) could hit 6 tokens, but the window group (blocks of 4)
    only ends blocks at multiples of 4, so both agree on 4."""
    manager = KVCacheManager(kv_cache_config(30, full_spec(2), window_spec(5, 4)), max_model_len=64)
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert (coordinator.hash_block_size, coordinator.alignment_tokens) == (2, 4)
    first = _request("a", list(range(8)))
    assert _admit(manager, first) == 0
    full_ids, window_ids = manager.get_block_ids("a")
    assert (full_ids, window_ids) == ([1, 2, 3, 4], [5, 6])
    # The window group keys block i by the request's hash (i + 1) * 2 - 1.
    blocks = manager.block_pool.blocks
    for idx, block_id in enumerate(window_ids):
        key = make_block_hash_with_group_id(first.block_hashes[2 * idx + 1], 1)
        assert blocks[block_id].block_hash == key
    second = _request("b", [*range(6), 50, 51, 52])  # shares 6 tokens
    assert _admit(manager, second) == 4
    full_ids, window_ids = manager.get_block_ids("b")
    assert full_ids[:2] == [1, 2] and window_ids[:1] == [5]


def test_mixed_sizes_cache_only_up_to_the_lcm() -> None:
    """A 6-token prompt fills 3 full-attention blocks of 2, but hits end on multiples of 4, so
    only the first 4 tokens' blocks enter the prefix cache (vLLM 0.33.0 does the same)."""
    manager = KVCacheManager(kv_cache_config(30, full_spec(2), window_spec(5, 4)), max_model_len=64)
    request = _request("a", list(range(7)))
    _admit(manager, request)
    blocks = manager.block_pool.blocks
    full_ids, window_ids = manager.get_block_ids("a")
    assert [blocks[i].block_hash is not None for i in full_ids] == [True, True, False, False]
    assert [blocks[i].block_hash is not None for i in window_ids] == [True, False]
    manager.free(request)
    manager.check_invariants()


def test_full_attention_may_use_the_larger_blocks() -> None:
    """Full attention in blocks of 4 beside a window in blocks of 2: the full group reads the
    view, the window group the request's own hashes."""
    manager = KVCacheManager(kv_cache_config(30, full_spec(4), window_spec(3, 2)), max_model_len=64)
    assert _admit(manager, _request("a", list(range(10)))) == 0
    assert _admit(manager, _request("b", [*range(9), 77])) == 8
    assert _admit(manager, _request("c", [*range(5), 77, 78, 79, 80])) == 4


@pytest.mark.parametrize("sizes", [(2, 4), (4, 2), (2, 6)])
def test_capacity_counts_each_group_at_its_own_block_size(sizes: tuple[int, int]) -> None:
    full_size, window_size = sizes
    config = kv_cache_config(40, full_spec(full_size), window_spec(5, window_size))
    manager = KVCacheManager(config, max_model_len=64)
    request = _request("a", list(range(13)))
    _admit(manager, request)
    full_ids, window_ids = manager.get_block_ids("a")
    assert len(full_ids) == math.ceil(13 / full_size)
    assert len(window_ids) == math.ceil(13 / window_size)
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 39


def test_the_manager_takes_the_gcd_as_hash_block_size() -> None:
    config = kv_cache_config(30, full_spec(2), window_spec(5, 4))
    KVCacheManager(config, max_model_len=64, hash_block_size=2)
    with pytest.raises(ValueError, match=r"hash_block_size=4 differs from 2, the gcd .* \[2, 4\]"):
        KVCacheManager(config, max_model_len=64, hash_block_size=4)


def test_scheduler_limits_hash_at_the_gcd_named_by_the_cache_config() -> None:
    config = kv_cache_config(60, full_spec(2), window_spec(5, 4))
    model = ModelInfo("m", 16, [], 64, config.kv_cache_groups)
    limits = resolve_limits(SchedulerConfig(), CacheConfig(block_size=2), config, model)
    # 32 blocks of 2 and 16 of 4 for 64 tokens: one step may schedule them all, window too.
    assert (limits.block_size, limits.num_blocks_per_request) == (2, 32 + 16)
    with pytest.raises(ValueError, match="hash at block_size=2: expected the cache config's 4"):
        resolve_limits(SchedulerConfig(), CacheConfig(block_size=4), config, model)
