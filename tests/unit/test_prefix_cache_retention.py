"""block_mask on cache_full_blocks and the prefix-cache retention interval of window groups."""

from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_specs import BLOCK_SIZE, full_spec, hashed_request, kv_cache_config, window_spec

from deploy.cli import core_main, core_parser, engine_config_from
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash, get_group_id
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.retention import validate_retention_interval, window_block_mask
from engine_core.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MLAAttentionSpec
from engine_core.sched.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig
from protocol.kv_events import BlockStored
from protocol.worker_messages import ModelInfo

WINDOW = window_spec(5)  # a hit reads cdiv(4, 2) = 2 blocks
INTERVAL = 8  # tokens: 4 blocks per segment, of which a window hit reads the last 2


def _admit_and_free(manager: KVCacheManager, request: Request) -> int:
    """Admit the whole prompt, cache it, free it; the hit length it found."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    manager.free(request)
    manager.check_invariants()
    return num_hit_tokens


def _num_indexed(pool: BlockPool, group_id: int) -> int:
    return sum(
        1
        for block in pool.blocks
        if block.block_hash is not None and get_group_id(block.block_hash) == group_id
    )


def test_masked_blocks_stay_out_of_the_index_and_out_of_block_stored() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, enable_kv_cache_events=True)
    hashes = [BlockHash(bytes([idx]) * 8) for idx in range(4)]
    request = SimpleNamespace(req_id="a", block_hashes=hashes, all_token_ids=array("l", range(8)))
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 0, 4, BLOCK_SIZE, 0, [True, False, True, True])
    assert [block.block_hash is not None for block in blocks] == [True, False, True, True]
    assert pool.cached_block_hash_to_block.num_blocks() == 3
    stored = [event for event in pool.take_events() if isinstance(event, BlockStored)]
    # Two runs: block 0 from the root, then blocks 2-3 chained on block 1's hash.
    assert [(event.block_hashes, event.parent_block_hash) for event in stored] == [
        ([bytes(hashes[0])], None),
        ([bytes(hashes[2]), bytes(hashes[3])], bytes(hashes[1])),
    ]
    pool.check_invariants()


def test_a_mask_of_the_wrong_length_is_refused_and_changes_nothing() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True)
    request = SimpleNamespace(req_id="a", block_hashes=[BlockHash(b"h" * 8)] * 3)
    blocks = pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="block_mask of 2 entries for blocks 0 to 3"):
        pool.cache_full_blocks(request, blocks, 0, 3, BLOCK_SIZE, 0, [True, True])
    assert all(block.block_hash is None for block in blocks)
    pool.check_invariants()


def test_window_mask_keeps_each_segment_tail_and_the_replay_tail() -> None:
    mask = window_block_mask(window_spec(3), 0, 12, 8, boundaries=[20])  # a 21-token prompt
    assert mask is not None
    assert [idx for idx, is_kept in enumerate(mask) if is_kept] == [3, 7, 9, 11]
    # The same answer when the blocks fill up a few at a time.
    pieces = [window_block_mask(window_spec(3), idx, idx + 3, 8, [20]) for idx in (0, 3, 6, 9)]
    assert [is_kept for piece in pieces for is_kept in piece or []] == mask


def test_window_mask_is_none_when_a_hit_reads_a_whole_segment() -> None:
    assert window_block_mask(window_spec(9), 0, 10, 8, boundaries=[19]) is None


def test_window_mask_also_keeps_the_tail_ending_at_a_shared_prefix_junction() -> None:
    mask = window_block_mask(window_spec(5), 0, 16, 8, boundaries=[32, 22])
    assert mask is not None
    # Segment tails 2-3, 6-7, 10-11, 14-15; the junction at token 22 keeps 9-10.
    assert [idx for idx, is_kept in enumerate(mask) if is_kept] == [2, 3, 6, 7, 9, 10, 11, 14, 15]


@pytest.mark.parametrize(
    ("interval", "specs", "message"),
    [
        (6, (full_spec(4), window_spec(5, 4)), "prefix_cache_retention_interval=6: expected a "),
        (0, (full_spec(), WINDOW), "prefix_cache_retention_interval=0: expected a positive"),
        (-4, (full_spec(), WINDOW), "prefix_cache_retention_interval=-4: expected a positive"),
        (8, (full_spec(),), "prefix_cache_retention_interval=8 is set but no KV-cache group"),
    ],
)
def test_retention_interval_is_validated_as_the_reference_does(
    interval: int, specs: tuple[KVCacheSpec, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        validate_retention_interval(interval, kv_cache_config(8, *specs))
    with pytest.raises(ValueError, match=message):
        KVCacheManager(kv_cache_config(8, *specs), 64, prefix_cache_retention_interval=interval)


def test_a_valid_interval_and_none_pass() -> None:
    validate_retention_interval(None, kv_cache_config(8, full_spec()))
    validate_retention_interval(16, kv_cache_config(8, full_spec(), WINDOW))


def test_resends_hit_as_far_with_fewer_window_blocks_indexed() -> None:
    prompt = list(range(100, 133))  # 33 tokens: 16 full blocks, replay boundary at token 32
    dense = KVCacheManager(kv_cache_config(80, full_spec(), WINDOW), 64)
    sparse = KVCacheManager(
        kv_cache_config(80, full_spec(), WINDOW), 64, prefix_cache_retention_interval=8
    )
    for manager in (dense, sparse):
        assert _admit_and_free(manager, hashed_request("a", prompt)) == 0
        assert _admit_and_free(manager, hashed_request("b", prompt)) == 32
    assert _num_indexed(dense.block_pool, 0) == _num_indexed(sparse.block_pool, 0) == 16
    assert _num_indexed(dense.block_pool, 1) == 16
    # Segment tails 2-3, 6-7, 10-11 and 14-15 (the last also the replay tail).
    assert _num_indexed(sparse.block_pool, 1) == 8


def test_a_sibling_between_kept_boundaries_falls_back_to_the_one_before() -> None:
    """The trade the interval makes: a sibling that leaves the shared prefix at token 20 hits
    only to 16, the last segment end, because the window blocks before 20 were not indexed."""
    prompt = list(range(100, 133))
    sibling = prompt[:20] + [7] * 13
    dense = KVCacheManager(kv_cache_config(80, full_spec(), WINDOW), 64)
    sparse = KVCacheManager(
        kv_cache_config(80, full_spec(), WINDOW), 64, prefix_cache_retention_interval=8
    )
    for manager in (dense, sparse):
        _admit_and_free(manager, hashed_request("a", prompt))
    assert _admit_and_free(dense, hashed_request("s", sibling)) == 20
    assert _admit_and_free(sparse, hashed_request("s", sibling)) == 16


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    order=st.lists(st.integers(0, 2), min_size=1, max_size=8),
    interval=st.sampled_from([8, 12, 16]),
)
def test_replays_hit_the_same_under_any_interval(
    prompt_lens: list[int], order: list[int], interval: int
) -> None:
    """Requests that replay earlier prompts hit exactly as far with the interval as without,
    and the window group never indexes more blocks."""
    prompts = [[idx * 1000 + pos for pos in range(n)] for idx, n in enumerate(prompt_lens)]
    dense = KVCacheManager(kv_cache_config(200, full_spec(), WINDOW), 64)
    sparse = KVCacheManager(
        kv_cache_config(200, full_spec(), WINDOW), 64, prefix_cache_retention_interval=interval
    )
    for step, prompt_idx in enumerate(order):
        prompt = prompts[prompt_idx % len(prompts)]
        num_dense = _admit_and_free(dense, hashed_request(f"r{step}", prompt))
        num_sparse = _admit_and_free(sparse, hashed_request(f"r{step}", prompt))
        assert num_sparse == num_dense
    assert _num_indexed(sparse.block_pool, 1) <= _num_indexed(dense.block_pool, 1)
    assert _num_indexed(sparse.block_pool, 0) == _num_indexed(dense.block_pool, 0)


def _engine_config_from(*argv: str) -> EngineConfig:
    return engine_config_from(core_parser().parse_args(list(argv)))


def test_the_flag_sets_the_cache_config_and_defaults_to_every_block() -> None:
    assert EngineConfig().cache.prefix_cache_retention_interval is None
    config = _engine_config_from("--block-size", "16", "--prefix-cache-retention-interval", "512")
    assert config.cache.prefix_cache_retention_interval == 512


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--prefix-cache-retention-interval", "0"],
            "--prefix-cache-retention-interval 0: expected `int` >= 1",
        ),
        (
            ["--block-size", "16", "--prefix-cache-retention-interval", "24"],
            "prefix_cache_retention_interval 24: expected a positive multiple of block_size 16",
        ),
    ],
)
def test_a_bad_interval_is_a_usage_error_naming_the_value(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exited:
        core_main(argv)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_scheduler_hands_the_interval_to_its_kv_cache_manager() -> None:
    groups = [
        KVCacheGroupSpec(["layer.0"], full_spec(4)),
        KVCacheGroupSpec(["layer.1"], window_spec(5, 4)),
    ]
    model_info = ModelInfo("fake", 64, [], 128, groups)
    cache_config = CacheConfig(block_size=4, prefix_cache_retention_interval=16)
    scheduler = Scheduler(SchedulerConfig(), cache_config, KVCacheConfig(80, groups), model_info)
    assert scheduler.kv_cache_manager.coordinator.retention_interval == 16


def test_block_stored_names_only_the_window_blocks_kept_in_the_index() -> None:
    """A router learns of exactly the window blocks a hit can use; full attention of all 16."""
    manager = KVCacheManager(
        kv_cache_config(80, full_spec(), WINDOW),
        64,
        enable_kv_cache_events=True,
        prefix_cache_retention_interval=8,
    )
    request = hashed_request("a", list(range(100, 133)))
    _admit_and_free(manager, request)
    stored = [event for event in manager.take_events() if isinstance(event, BlockStored)]
    hashes = [bytes(block_hash) for block_hash in request.block_hashes]
    by_group: dict[int, list[bytes]] = {0: [], 1: []}
    for event in stored:
        by_group[event.group_idx].extend(event.block_hashes)
    assert by_group[0] == hashes[:16]
    assert by_group[1] == [hashes[idx] for idx in (2, 3, 6, 7, 10, 11, 14, 15)]


def test_a_sibling_keeps_the_junction_so_the_next_sibling_hits_all_of_the_shared_prefix() -> None:
    """As vLLM's scheduler does with a lookup's shared_prefix_boundary: the first sibling that
    leaves A's prompt at token 20 hits only to 16, but keeps its window tail at 20 (the junction
    full attention reached), so the next sibling hits the whole shared 20."""
    prompt = list(range(100, 133))
    sparse = KVCacheManager(
        kv_cache_config(80, full_spec(), WINDOW), 64, prefix_cache_retention_interval=8
    )
    _admit_and_free(sparse, hashed_request("a", prompt))
    first = hashed_request("s1", prompt[:20] + [7] * 13)
    hits, num_hit_tokens = sparse.get_computed_blocks(first)
    assert (num_hit_tokens, hits.shared_prefix_boundary) == (16, 20)
    assert _admit_and_free(sparse, first) == 16
    assert _admit_and_free(sparse, hashed_request("s2", prompt[:20] + [9] * 13)) == 20


def test_no_junction_without_a_retention_interval() -> None:
    dense = KVCacheManager(kv_cache_config(80, full_spec(), WINDOW), 64)
    _admit_and_free(dense, hashed_request("a", list(range(100, 133))))
    hits, num_hit_tokens = dense.get_computed_blocks(hashed_request("s", [*range(100, 120), 7]))
    assert (num_hit_tokens, hits.shared_prefix_boundary) == (20, 0)


def _mixed_manager(is_masked: bool = True) -> KVCacheManager:
    """Full attention in blocks of 4 beside a 3-token window in blocks of 2: hits end on 4."""
    manager = KVCacheManager(kv_cache_config(400, full_spec(4), window_spec(3)), 128)
    if not is_masked:  # the index as it would be if every window block were entered
        manager.coordinator._window_group_ids = frozenset()
    return manager


def test_mixed_block_sizes_index_only_window_blocks_that_end_on_the_lcm() -> None:
    manager = _mixed_manager()
    prompt = list(range(100, 117))  # 17 tokens: 8 window blocks, 4 full-attention blocks
    assert _admit_and_free(manager, hashed_request("a", prompt)) == 0
    # Window blocks 1, 3, 5 and 7 (each ends a 4-token boundary) of 8; all 4 of full attention.
    assert (_num_indexed(manager.block_pool, 0), _num_indexed(manager.block_pool, 1)) == (4, 4)
    assert _admit_and_free(manager, hashed_request("b", prompt)) == 16


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=8),
)
def test_mixed_block_sizes_hit_as_far_with_the_window_mask(
    prompt_lens: list[int], steps: list[tuple[int, int]]
) -> None:
    """Against the same manager without the mask: every hit length is the same (the masked
    blocks end no 4-aligned hit), and the window group never indexes more blocks."""
    prompts = [[idx * 1000 + pos for pos in range(n)] for idx, n in enumerate(prompt_lens)]
    masked, unmasked = _mixed_manager(), _mixed_manager(is_masked=False)
    for step, (prompt_idx, num_shared) in enumerate(steps):
        base = prompts[prompt_idx % len(prompts)]
        prompt = base[:num_shared] + [7, 8, 9][: max(1, len(base) - num_shared)]
        num_masked = _admit_and_free(masked, hashed_request(f"r{step}", prompt))
        assert num_masked == _admit_and_free(unmasked, hashed_request(f"r{step}", prompt))
    num_window_masked = _num_indexed(masked.block_pool, 1)
    assert num_window_masked <= _num_indexed(unmasked.block_pool, 1)
    assert _num_indexed(masked.block_pool, 0) == _num_indexed(unmasked.block_pool, 0)


@settings(max_examples=40, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    order=st.lists(st.integers(0, 2), min_size=1, max_size=8),
    cut=st.integers(1, 39),
)
def test_an_mla_group_listed_after_a_window_acts_as_full_attention(
    prompt_lens: list[int], order: list[int], cut: int
) -> None:
    """MLA layers read the whole prefix: beside a window group, listed after it, a manager over
    MLA finds every hit and every shared-prefix junction a manager over full attention finds
    (the junction is measured in the prefix-reading group, wherever it is listed)."""
    mla = MLAAttentionSpec(block_size=BLOCK_SIZE, latent_dim=8, dtype="float32")
    base = [[idx * 1000 + pos for pos in range(n)] for idx, n in enumerate(prompt_lens)]
    prompts = [*base, base[0][:cut] + [7] * 9]  # a sibling that leaves prompt 0 at `cut`
    managers = [
        KVCacheManager(kv_cache_config(200, WINDOW, spec), 64, prefix_cache_retention_interval=8)
        for spec in (full_spec(), mla)
    ]
    for step, prompt_idx in enumerate([*order, len(prompts) - 1]):
        prompt = prompts[prompt_idx % len(prompts)]
        found = []
        for manager in managers:
            request = hashed_request(f"r{step}", prompt)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            found.append((num_hit_tokens, hits.shared_prefix_boundary))
            assert manager.allocate_slots(
                request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
            )
            manager.free(request)
            manager.check_invariants()
        assert found[0] == found[1], f"step {step}: full attention {found[0]}, MLA {found[1]}"
