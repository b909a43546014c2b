"""The tiers below the pool, engine side (DESIGN.md §3.5): each step's copies in order, host and
disk hits, failed disk slots as misses, KV events per medium, recovery, and the slot plan.

The fake workers (fake_executor.TierMemory) run every copy on modelled pages and sample from
what the pages hold, so a copy that moved the wrong page, or read a slot never written, changes
the tokens or fails an assertion.
"""

import random
import signal

import pytest
from fake_executor import MakeHarness, reference_tokens

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.kv_tiers import KVTiers
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.tier_hits import TierHit
from engine_core.service import engine_process
from engine_core.service.plan import FlagValueError, plan_engine, plan_tier_slots
from engine_core.service.server import EXIT_USAGE
from engine_core.workers.rank_agreement import with_every_failed_disk_slot
from protocol import PROTOCOL_VERSION
from protocol.buffers import pack_int32, unpack_int32
from protocol.config import CacheConfig, EngineConfig
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    bytes_per_block,
)
from protocol.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, BlockRemoved, BlockStored
from protocol.stats import PrefixCacheStats
from protocol.worker_messages import KVTransfers, ModelInfo, ModelRunnerOutput, WorkerHello

PROMPT_A = list(range(1, 13))  # three full blocks of 4
PROMPT_B = list(range(30, 50))  # five blocks: with a pool of 6 it evicts two of A's
PROMPT_C = list(range(10, 30))
TINY_POOL = {"num_blocks": 7, "block_size": 4, "max_model_len": 24}


def _lists(transfers: KVTransfers | None) -> list[list[int]]:
    """The four lists of a step's copies, in the order the ranks run them."""
    if transfers is None:
        return [[], [], [], []]
    fields = ("host_to_disk", "device_to_host", "disk_to_host", "host_to_device")
    return [list(unpack_int32(getattr(transfers, name))) for name in fields]


def test_an_evicted_prefix_comes_back_from_the_host_tier(make_harness: MakeHarness) -> None:
    harness = make_harness(num_host_slots=8, **TINY_POOL)
    harness.add("a", PROMPT_A, max_tokens=1)
    harness.run()
    harness.add("b", PROMPT_B, max_tokens=1)
    harness.run()
    # A's blocks 1, 2, 3 were freed tail first; B's five blocks reuse 3 then 2: copied out
    # to host slots 0 and 1 in the step that reuses them, before its forward overwrites them.
    assert _lists(harness.scheduler_outputs[2].kv_transfers) == [[], [3, 0, 2, 1], [], []]
    harness.add("a2", [*PROMPT_A, 60], max_tokens=3)
    harness.run()
    # A's first block is still in the pool (block 1); its next two come in from the host tier
    # into fresh blocks 2 and 3 (whose cached B blocks go down first, in the same step).
    assert _lists(harness.scheduler_outputs[4].kv_transfers) == [
        [],
        [2, 2, 3, 3, 6, 4],
        [],
        [1, 2, 0, 3],
    ]
    assert harness.num_cached_tokens["a2"] == 12  # every tier's hit counts
    assert harness.tokens["a2"] == reference_tokens([*PROMPT_A, 60], 3, harness.vocab_size)
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert (stats.hits, stats.host_hits, stats.disk_hits) == (12, 8, 0)
    assert (stats.blocks_to_host, stats.blocks_from_host) == (5, 2)


def test_a_disk_hit_waits_one_step_for_its_confirmed_copy(make_harness: MakeHarness) -> None:
    harness = make_harness(num_host_slots=2, num_disk_slots=8, **TINY_POOL)
    for req_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        harness.add(req_id, prompt, max_tokens=1)
        harness.run()
    # C's admission pushed A's host blocks on to disk (host_to_disk first, then the slots
    # take B's evicted pages).
    assert _lists(harness.scheduler_outputs[4].kv_transfers) == [
        [0, 0, 1, 1],
        [1, 0, 2, 1],
        [],
        [],
    ]
    harness.add("a2", [*PROMPT_A, 60], max_tokens=3)
    harness.run()
    promote, admit = harness.scheduler_outputs[6], harness.scheduler_outputs[7]
    # The step that finds the disk hit only copies it up (after moving a host victim down)
    # and schedules nothing; the next, its reply confirmed, copies it in and runs the request.
    assert _lists(promote.kv_transfers) == [[1, 2], [], [1, 1], []]
    assert promote.total_num_scheduled_tokens == 0
    assert _lists(admit.kv_transfers) == [[], [], [], [0, 4, 1, 5]]
    assert harness.num_cached_tokens["a2"] == 8
    assert harness.tokens["a2"] == reference_tokens([*PROMPT_A, 60], 3, harness.vocab_size)
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    # Each hit counts once, in the tier it was found in: A's first block was still on the host
    # tier, its second came up from disk (and then in through the host tier, as a disk hit).
    assert (stats.hits, stats.host_hits, stats.disk_hits) == (8, 4, 4)
    assert (stats.blocks_from_disk, stats.blocks_from_host) == (1, 2)


def test_each_hit_counts_once_in_the_tier_it_came_from(make_harness: MakeHarness) -> None:
    """A disk hit goes up through the host tier, and a second request of the prefix then hits
    the device pool: every hit counts once, in its own tier, and `hits` counts all of them."""
    harness = make_harness(num_host_slots=2, num_disk_slots=8, **TINY_POOL)
    for req_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        harness.add(req_id, prompt, max_tokens=1)
        harness.run()
    harness.add("a2", [*PROMPT_A, 60], max_tokens=3)
    harness.add("a3", [*PROMPT_A, 61], max_tokens=3)
    harness.run()
    assert (harness.num_cached_tokens["a2"], harness.num_cached_tokens["a3"]) == (8, 12)
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    # a2: one block from the host tier, one from disk; a3: A's three blocks, all on device.
    assert (stats.hits, stats.host_hits, stats.disk_hits) == (20, 4, 4)
    assert (stats.blocks_from_disk, stats.blocks_from_host) == (1, 2)


def test_a_block_the_host_still_holds_is_not_copied_down_again(make_harness: MakeHarness) -> None:
    """A and B take turns in a pool that holds one of them: each comes back from the host tier
    and is evicted again, and only its first eviction costs a copy (the hierarchy is inclusive)."""
    harness = make_harness(num_host_slots=16, **TINY_POOL)
    for idx in range(6):
        prompt = PROMPT_A if idx % 2 == 0 else PROMPT_B
        harness.add(f"r{idx}", [*prompt, 60 + idx], max_tokens=1)
        harness.run()
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    tiers = harness.scheduler.kv_cache_manager.tiers
    assert tiers is not None and len(tiers.host) == 6
    assert (stats.blocks_to_host, stats.blocks_from_host) == (6, 6)


def test_a_disk_slot_that_fails_its_checksum_is_a_miss(make_harness: MakeHarness) -> None:
    """Guards against a corrupt disk slot reaching attention: the request recomputes it."""
    harness = make_harness(num_host_slots=2, num_disk_slots=8, **TINY_POOL)
    for req_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        harness.add(req_id, prompt, max_tokens=1)
        harness.run()
    assert harness.tier_memory is not None
    harness.tier_memory.corrupt_disk_slots.update(range(8))
    harness.add("a2", [*PROMPT_A, 60], max_tokens=3)
    harness.run()
    assert harness.num_cached_tokens["a2"] == 4
    assert harness.tokens["a2"] == reference_tokens([*PROMPT_A, 60], 3, harness.vocab_size)
    tiers = harness.scheduler.kv_cache_manager.tiers
    assert tiers is not None and tiers.disk is not None and len(tiers.disk) == 2  # A's 2nd left
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert (stats.disk_read_failures, stats.disk_hits) == (1, 0)


def _workload(seed: int) -> list[tuple[str, list[int], int]]:
    """Multi-turn-like prompts: a few shared documents, each with turns that extend it."""
    rng = random.Random(seed)
    docs = [[rng.randrange(64) for _ in range(rng.randrange(8, 20))] for _ in range(5)]
    requests = []
    for idx in range(40):
        doc = rng.choice(docs)
        suffix = [rng.randrange(64) for _ in range(rng.randrange(1, 6))]
        requests.append((f"r{idx}", (doc + suffix)[:30], rng.randrange(1, 6)))
    return requests


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("num_host_slots", "num_disk_slots"), [(0, 0), (6, 0), (3, 12)])
def test_tokens_are_those_of_the_prompt_alone_with_tiers_on_and_off(
    make_harness: MakeHarness,
    async_scheduling: bool,
    num_host_slots: int,
    num_disk_slots: int,
    sliding_window: int | None,
) -> None:
    """A pool of 11 blocks (20 beside a window) under 40 requests over 5 documents: most hits
    come from the tiers, with preemption, and the tokens never change. With tiers, the workers
    sample from the pages of every group."""
    harness = make_harness(
        num_blocks=12 if sliding_window is None else 21,
        block_size=4,
        max_model_len=40,
        sliding_window=sliding_window,
        num_host_slots=num_host_slots,
        num_disk_slots=num_disk_slots,
        async_scheduling=async_scheduling,
        max_num_seqs=3,
    )
    requests = _workload(7)
    for start in range(0, len(requests), 3):
        for req_id, prompt, max_tokens in requests[start : start + 3]:
            harness.add(req_id, prompt, max_tokens=max_tokens)
        for _ in range(3):
            harness.step()
    harness.run()
    for req_id, prompt, max_tokens in requests:
        assert harness.tokens[req_id] == reference_tokens(prompt, max_tokens, harness.vocab_size)
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    if num_host_slots:
        assert stats.host_hits > 0 and stats.blocks_to_host > 0
    if num_disk_slots:
        assert stats.blocks_to_disk > 0 and stats.disk_hits > 0


def _tier_manager(num_host_slots: int, num_disk_slots: int) -> KVCacheManager:
    spec = FullAttentionSpec(4, 1, 8, "float32")
    config = KVCacheConfig(
        4,
        [KVCacheGroupSpec(["layer.0"], spec)],
        num_host_slots=num_host_slots,
        num_disk_slots=num_disk_slots,
    )
    return KVCacheManager(config, 64, enable_kv_cache_events=True)


def test_a_block_moving_down_is_removed_on_one_medium_and_stored_on_the_next() -> None:
    manager = _tier_manager(1, 4)
    tiers = manager.tiers
    assert tiers is not None
    pool = manager.block_pool
    first, second = b"\x01" * 32, b"\x02" * 32
    for block, block_hash in zip(pool.blocks[1:3], (first, second), strict=True):
        block.block_hash = block_hash + bytes(4)
        pool.cached_block_hash_to_block.file_first(block.block_hash, block)
    pool.get_new_blocks(1)  # the head is block 1: the pool evicts `first` to the host tier
    manager.take_kv_transfers(1)
    pool.get_new_blocks(1)  # `second` takes the host slot; `first` moves on to disk
    assert manager.take_events() == [
        BlockRemoved([first], MEDIUM_GPU, group_idx=0),
        BlockStored([first], None, [], 4, None, MEDIUM_CPU, None, None, 0),
        BlockRemoved([second], MEDIUM_GPU, group_idx=0),
        BlockRemoved([first], MEDIUM_CPU, group_idx=0),
        BlockStored([first], None, [], 4, None, MEDIUM_DISK, None, None, 0),
        BlockStored([second], None, [], 4, None, MEDIUM_CPU, None, None, 0),
    ]
    assert _lists(manager.take_kv_transfers(2)) == [[0, 0], [2, 0], [], []]


def test_a_reset_or_a_recovery_empties_the_tiers_with_their_events() -> None:
    """A new worker generation starts with empty tier memory: the engine forgets every slot."""
    manager = _tier_manager(1, 4)
    tiers = manager.tiers
    assert tiers is not None and tiers.disk is not None
    for step_id in (1, 2):  # two steps: the second moves the first block on to disk
        tiers.on_device_evict(step_id, bytes([step_id]) * 32 + bytes(4))
        manager.take_kv_transfers(step_id)
        manager.on_step_reply(step_id, b"")
    manager.take_events()
    assert manager.reset_prefix_cache()
    assert len(tiers.host) == 0 and len(tiers.disk) == 0
    events = manager.take_events()
    assert events[:2] == [
        BlockRemoved([b"\x02" * 32], MEDIUM_CPU, group_idx=0),
        BlockRemoved([b"\x01" * 32], MEDIUM_DISK, group_idx=0),
    ]
    assert type(events[2]).__name__ == "AllBlocksCleared"
    assert manager.make_prefix_cache_stats().resets == 1


def test_the_recovery_requeue_forgets_the_tiers(make_harness: MakeHarness) -> None:
    harness = make_harness(num_host_slots=8, **TINY_POOL)
    for req_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        harness.add(req_id, prompt, max_tokens=1)
        harness.run()
    tiers = harness.scheduler.kv_cache_manager.tiers
    assert tiers is not None and len(tiers.host) == 2
    harness.scheduler.requeue_for_new_workers()
    assert len(tiers.host) == 0
    assert harness.tier_memory is not None
    harness.tier_memory.host.clear()  # the new generation's memory is empty
    harness.tier_memory.pages.clear()
    harness.add("a2", [*PROMPT_A, 60], max_tokens=2)
    harness.run()
    assert harness.num_cached_tokens["a2"] == 0
    assert harness.tokens["a2"] == reference_tokens([*PROMPT_A, 60], 2, harness.vocab_size)


def test_a_failed_disk_write_drops_the_key_and_a_late_report_is_ignored() -> None:
    stats = PrefixCacheStats()
    tiers = KVTiers(BlockPool(4, True), 1, 2, [4], stats)
    first, second = b"\x01" * 36, b"\x02" * 36
    tiers.on_device_evict(1, first)
    tiers.take_transfers(1)
    tiers.on_device_evict(2, second)  # `first` goes to disk slot 0
    transfers = tiers.take_transfers(2)
    assert _lists(transfers)[0] == [0, 0]
    assert tiers.disk is not None and tiers.disk.slot_of(first) == 0
    assert tiers.disk.lookup(first) is None  # unconfirmed: no hit yet
    tiers.on_step_reply(1, b"")
    tiers.on_step_reply(2, pack_int32([0]))
    assert first not in tiers.disk and stats.disk_write_failures == 1
    tiers.on_step_reply(3, pack_int32([1]))  # a step that copied nothing: logged, ignored
    tiers.check_invariants()


def test_a_host_hit_read_this_step_is_not_evicted_by_the_same_step() -> None:
    """Guards against overwriting a host slot that host_to_device reads later in the step."""
    tiers = KVTiers(BlockPool(4, True), 1, 0, [4], PrefixCacheStats())
    key = b"\x01" * 32 + bytes(4)
    tiers.on_device_evict(1, key)
    tiers.take_transfers(1)
    (hit,) = tiers.view(include_disk=False).get_cached_prefix([key[:-4]], 1, 0)
    assert isinstance(hit, TierHit) and (hit.tier_slot, hit.block_hash) == (0, key)
    tiers.pin_host_slots([hit.tier_slot])
    tiers.on_device_evict(2, b"\x02" * 32 + bytes(4))  # the one slot is pinned: dropped
    tiers.copy_in(hit.tier_slot, 3)
    assert _lists(tiers.take_transfers(2)) == [[], [], [], [0, 3]]


def test_every_ranks_failed_disk_slots_are_merged() -> None:
    outputs = [
        ModelRunnerOutput(5, rank, b"", b"", 1, failed_disk_slots=pack_int32(failed))
        for rank, failed in enumerate(([3], [], [1, 3]))
    ]
    merged = with_every_failed_disk_slot(outputs)
    assert merged.rank == 0 and list(unpack_int32(merged.failed_disk_slots)) == [1, 3]


GROUPS = [KVCacheGroupSpec(["layers.0"], FullAttentionSpec(4, 2, 8, "float32"))]


def test_the_slots_split_the_budgets_over_the_ranks() -> None:
    page_bytes = bytes_per_block(GROUPS, 2)
    cache = CacheConfig(
        block_size=4,
        kv_offload_host_bytes=10 * page_bytes * 2 + 5,
        kv_offload_disk_bytes=40 * page_bytes * 2,
        kv_offload_disk_dir="/tmp/tiers",
    )
    assert plan_tier_slots(cache, GROUPS, 2) == (10, 40)
    config = EngineConfig(tp_size=2, cache=cache).checked()
    model = ModelInfo("tiny", 64, [], 32, GROUPS)
    kv_cache_config = plan_engine(config, model, [40, 40]).kv_cache_config
    assert (kv_cache_config.num_host_slots, kv_cache_config.num_disk_slots) == (10, 40)
    assert kv_cache_config.disk_dir == "/tmp/tiers"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_offload_host_bytes": 100}, r"--kv-offload-host-bytes 100 gives each of the 2 ranks"),
        ({"kv_offload_disk_bytes": 10**6, "kv_offload_disk_dir": "d"}, "needs a host tier"),
        ({"kv_offload_host_bytes": 10**6, "kv_offload_disk_bytes": 10**6}, "needs --kv-offload"),
        ({"kv_offload_host_bytes": 10**6, "enable_prefix_caching": False}, "prefix caching on"),
    ],
)
def test_a_budget_that_cannot_work_names_its_flag(fields: dict, message: str) -> None:
    with pytest.raises(FlagValueError, match=message):
        plan_tier_slots(CacheConfig(block_size=4, **fields), GROUPS, 2)


def test_tiers_serve_windows_and_mamba_states_beside_full_attention() -> None:
    window = SlidingWindowSpec(4, 2, 8, "float32", sliding_window=8)
    mamba = MambaSpec(4, ((2, 3),), "float32", mamba_cache_mode="align")
    cache = CacheConfig(block_size=4, kv_offload_host_bytes=10**6)
    for spec in (window, mamba):
        assert plan_tier_slots(cache, [*GROUPS, KVCacheGroupSpec(["layers.1"], spec)], 1)[0] > 0


class _HelloWorkers:
    """Ranks that said hello with a model whose page is larger than the host budget's share."""

    def __init__(self, model: ModelInfo, tp_size: int) -> None:
        self.hellos = [
            WorkerHello(PROTOCOL_VERSION, rank, tp_size, 1, "here", "cpu", model, 40)
            for rank in range(tp_size)
        ]
        self.shutdowns: list[tuple[str, bool]] = []

    def wait_for_hellos(self, deadline: float) -> list[WorkerHello]:
        return self.hellos

    def shutdown(self, reason: str, is_failure: bool = False) -> None:
        self.shutdowns.append((reason, is_failure))


def test_a_host_budget_below_one_page_stops_the_engine_with_exit_2() -> None:
    """Only the handshake knows the page size; the refusal is still a usage error naming the
    flag. No sockets: the ranks are a stand-in, and the stop handlers are put back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    config = EngineConfig(
        tp_size=2, cache=CacheConfig(block_size=4, kv_offload_host_bytes=100)
    ).checked()
    workers = _HelloWorkers(ModelInfo("tiny", 64, [], 32, GROUPS), 2)
    try:
        code = engine_process._start_and_serve(
            config,
            None,  # type: ignore[arg-type]  # the context and endpoints are never reached
            None,  # type: ignore[arg-type]
            [],
            workers,  # type: ignore[arg-type]
            None,
            None,
        )
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    assert code == EXIT_USAGE
    ((reason, is_failure),) = workers.shutdowns
    assert "--kv-offload-host-bytes 100 gives each of the 2 ranks 50 bytes" in reason
    assert is_failure
