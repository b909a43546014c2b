"""Cross-attention groups: encoder blocks taken whole at admission, never cached, freed with the
request, and never a limit on the decoder groups' prefix hit."""

from array import array

import pytest
from kv_specs import BLOCK_SIZE, full_spec, kv_cache_config

from engine_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    get_kv_cache_coordinator,
)
from engine_core.kv_cache.cross_attention_manager import CrossAttentionManager
from engine_core.kv_cache.hashing import BlockHasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.spec import (
    CrossAttentionSpec,
    KVCacheGroupSpec,
    num_blocks_per_request,
    num_group_blocks_per_request,
)
from engine_core.sched.request import Request
from protocol.sampling import SamplingParams

MAX_ENCODER_TOKENS = 6


def cross_spec(block_size: int = BLOCK_SIZE) -> CrossAttentionSpec:
    return CrossAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        max_num_encoder_tokens=MAX_ENCODER_TOKENS,
    )


def _manager(num_blocks: int = 20, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        kv_cache_config(num_blocks, full_spec(), cross_spec()),
        max_model_len=32,
        enable_caching=enable_caching,
    )


def _request(req_id: str, prompt: list[int], encoder: list[int]) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(),
        block_hasher=BlockHasher(BLOCK_SIZE),
        encoder_token_ids=array("i", encoder),
    )


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Admit the whole prompt with its hits; the hit length in tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request,
        request.num_tokens - num_hit,
        num_hit,
        hits,
        num_encoder_tokens=request.num_encoder_tokens,
    )
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_invariants()
    return num_hit


def test_factory_gives_the_hybrid_coordinator_a_cross_attention_manager() -> None:
    config = kv_cache_config(8, full_spec(), cross_spec())
    coordinator = get_kv_cache_coordinator(config, True)
    assert type(coordinator) is HybridKVCacheCoordinator
    assert type(coordinator.single_type_managers[1]) is CrossAttentionManager
    assert coordinator.is_cross_attention == (False, True)
    assert type(get_kv_cache_coordinator(config, False)) is KVCacheCoordinatorNoPrefixCache


def test_a_model_of_cross_attention_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="only KV-cache group is cross-attention"):
        get_kv_cache_coordinator(kv_cache_config(8, cross_spec()), True)


def test_admission_takes_every_encoder_block_and_decode_never_grows_them() -> None:
    manager = _manager()
    request = _request("a", [1, 2, 3], [9, 9, 9, 9, 9])
    _admit(manager, request)
    # The decoder's 3 tokens take 2 blocks; the 5 encoder tokens take 3, all at admission.
    assert manager.get_block_ids("a") == ([1, 2], [3, 4, 5])
    for token_id in (4, 5, 6):
        request.append_output_token_ids(token_id)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_invariants()
    assert manager.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])


def test_encoder_blocks_are_never_hashed_and_freed_tail_first_with_the_request() -> None:
    manager = _manager(num_blocks=12)
    request = _request("a", [1, 2, 3, 4, 5], [9, 8, 7, 6])
    _admit(manager, request)
    assert manager.get_block_ids("a") == ([1, 2, 3], [4, 5])
    blocks = manager.block_pool.blocks
    assert [blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]
    assert [blocks[i].block_hash for i in (4, 5)] == [None, None]
    manager.free(request)
    manager.check_invariants()
    assert manager.block_pool.get_num_free_blocks() == 11
    # Unhashed blocks go to the head, so the encoder's (freed last) are reused first; the
    # cached decoder blocks wait at the tail, their prefix's tail before its head.
    free_ids = [
        block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()
    ]
    assert free_ids == [5, 4, 3, 6, 7, 8, 9, 10, 11, 2, 1]


def test_a_hit_covers_decoder_blocks_only_and_the_encoder_gets_fresh_blocks() -> None:
    manager = _manager()
    first = _request("a", [1, 2, 3, 4, 5], [9, 8, 7])
    _admit(manager, first)
    twin = _request("b", [1, 2, 3, 4, 5], [9, 8, 7])
    hits, num_hit = manager.get_computed_blocks(twin)
    assert num_hit == 4
    assert [len(group) for group in hits.blocks] == [2, 0]  # the encoder group never hits
    assert _admit(manager, twin) == 4
    assert manager.get_block_ids("a") == ([1, 2, 3], [4, 5])
    assert manager.get_block_ids("b") == ([1, 2, 6], [7, 8])


def test_another_encoder_input_misses_the_same_decoder_prompt() -> None:
    """Decoder K/V past the first cross-attention layer depend on the encoder input: equal
    prompts under different encoder inputs must not share blocks (a false hit changes tokens)."""
    manager = _manager()
    _admit(manager, _request("a", [1, 2, 3, 4, 5], [9, 8, 7]))
    assert _admit(manager, _request("b", [1, 2, 3, 4, 5], [9, 8, 6])) == 0
    decoder_only = Request("c", [1, 2, 3, 4, 5], SamplingParams(), block_hasher=BlockHasher(2))
    assert manager.get_computed_blocks(decoder_only)[1] == 0


def test_a_failed_admission_counts_the_encoder_blocks_and_changes_nothing() -> None:
    manager = _manager(num_blocks=6)  # 5 usable
    request = _request("a", [1, 2, 3], [9, 9, 9, 9, 9])  # 2 decoder + 3 encoder blocks: fits
    assert manager.allocate_slots(request, 3, num_encoder_tokens=5) is not None
    second = _request("b", [1], [9, 9])  # 1 + 1 blocks, but none is free
    assert manager.allocate_slots(second, 1, num_encoder_tokens=2) is None
    manager.check_invariants()
    assert manager.get_block_ids("b") == ([], [])
    assert manager.block_pool.get_num_free_blocks() == 0


def test_a_preempted_request_gets_new_encoder_blocks_when_admitted_again() -> None:
    manager = _manager(num_blocks=12, enable_caching=False)
    request = _request("a", [1, 2, 3], [9, 9, 9])
    _admit(manager, request)
    assert manager.get_block_ids("a") == ([1, 2], [3, 4])
    manager.free(request)  # preempted: every block goes back, the encoder's too
    request.num_computed_tokens = 0
    other = _request("b", [5], [6])
    _admit(manager, other)
    _admit(manager, request)
    manager.check_invariants()
    assert len(manager.get_block_ids("a")[1]) == 2
    assert manager.block_pool.get_num_free_blocks() == 11 - 2 - 4


def test_capacity_counts_the_encoder_blocks_by_the_model_limit() -> None:
    spec = cross_spec()
    assert num_group_blocks_per_request(spec, 100, None) == 3  # cdiv(6, 2), whatever the length
    assert num_group_blocks_per_request(spec, 100, 8) == 3
    groups = [KVCacheGroupSpec(["f"], full_spec()), KVCacheGroupSpec(["x"], spec)]
    assert num_blocks_per_request(groups, 10) == 5 + 3
