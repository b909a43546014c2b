"""KV-cache coordinators: one BlockPool shared by every KV-cache group, one manager per group.

A coordinator fans each request operation out to the per-group managers and, for prefix hits,
decides one hit length that every group can honour. It never hashes tokens or sizes memory.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_metrics import BlockMetricsHook
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.block_sized_request import RequestAtBlockSize
from engine_core.kv_cache.cross_attention_manager import CrossAttentionManager
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.hybrid_hit_search import BlocksPerGroup, HitLengths, HybridHitSearch
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.retention import (
    cache_retained_blocks,
    sparse_retention_group_ids,
    validate_retention_interval,
    window_group_ids,
)
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.kv_cache.spec import KVCacheConfig
from engine_core.kv_cache.spec_managers import make_single_type_manager
from engine_core.kv_cache.tier_hits import HitSource

__all__ = [
    "BlocksPerGroup",
    "HitLengths",
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]


class KVCacheCoordinator(ABC):
    """Runs each request operation over every group's manager, against one shared BlockPool.

    Invariants: each group's manager holds its own invariants, and every non-null block's
    `ref_cnt` equals the number of request tables, over all groups, that list it.
    """

    # Where cache_blocks stops: a multiple of this many tokens (the lcm of mixed block sizes).
    cache_alignment_tokens = 1

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsHook | None = None,
        retention_interval: int | None = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        # References held outside the request tables (P/D pins and pulls, engine_core/
        # kv_transfer/): each callable lists its blocks, one entry per reference
        self.block_holders: list[Callable[[], Iterable[KVCacheBlock]]] = []
        # None caches every full block; an interval thins the window groups' (retention.py).
        self.retention_interval = retention_interval
        self._sparse_group_ids = sparse_retention_group_ids(retention_interval, kv_cache_config)
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events, metrics_collector
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_single_type_manager(group.spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        # Only the kinds whose attention stops reading some earlier tokens ever skip blocks
        # (each manager's `can_skip_blocks`): sliding windows, chunked local attention, R-SWA's
        # gap and Mamba's older states. Full and cross attention pay nothing for it:
        # remove_skipped_blocks never asks them.
        self._skipping_managers = tuple(
            manager for manager in self.single_type_managers if manager.can_skip_blocks
        )
        self.can_skip_blocks = bool(self._skipping_managers)
        # Cross-attention groups size their tables by the encoder's tokens, not the decoder's.
        self.is_cross_attention = tuple(
            isinstance(manager, CrossAttentionManager) for manager in self.single_type_managers
        )
        # Each group's `is_step_in_place`, and whether it counts encoder tokens: asked on most
        # decode steps of a hybrid model, so bound once here.
        self._step_in_place_questions = tuple(
            zip(
                [manager.is_step_in_place for manager in self.single_type_managers],
                self.is_cross_attention,
                strict=True,
            )
        )

    def get_num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        num_encoder_tokens: int = 0,
    ) -> int:
        """Free blocks an allocation up to `num_tokens` consumes, over every group
        (`num_encoder_tokens` in a cross-attention group)."""
        num_blocks = 0
        for manager, blocks, is_cross in zip(
            self.single_type_managers, new_computed_blocks, self.is_cross_attention, strict=True
        ):
            num_group_tokens = num_encoder_tokens if is_cross else num_tokens
            num_blocks += manager.get_num_blocks_to_allocate(req_id, num_group_tokens, blocks)
        return num_blocks

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: BlocksPerGroup, is_touched: bool = False
    ) -> None:
        """Touch every group's hits (unless the caller did), then start the request's tables.

        All hits are touched before any new block is allocated, so the allocation of one group
        can never evict the hit blocks of another.
        """
        if self.enable_caching and not is_touched:
            for blocks in new_computed_blocks:
                if blocks:
                    self.block_pool.touch(blocks)
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(req_id, blocks)

    def has_request(self, req_id: str) -> bool:
        """Whether the request holds a table (it was allocated and not freed since)."""
        return self.single_type_managers[0].has_request(req_id)

    def is_step_in_place(
        self,
        request: KVCacheRequest,
        num_tokens: int,
        num_real_tokens: int,
        num_encoder_tokens: int = 0,
    ) -> bool:
        """Whether, for a request that holds its tables, `allocate_new_blocks` and `cache_blocks`
        with these counts would change nothing in any group (each manager's `is_step_in_place`).

        Then `get_num_blocks_to_allocate` is 0 too, and an allocation only hands skipped blocks
        back. A request that holds no table is never in place.
        """
        alignment = self.cache_alignment_tokens  # cache_blocks stops on its multiples
        num_real_tokens = num_real_tokens // alignment * alignment
        for is_group_in_place, is_cross in self._step_in_place_questions:
            num_group_tokens = num_encoder_tokens if is_cross else num_tokens
            if not is_group_in_place(request, num_group_tokens, num_real_tokens):
                return False
        return True

    def allocate_new_blocks(
        self, req_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            [
                manager.allocate_new_blocks(req_id, num_encoder_tokens if is_cross else num_tokens)
                for manager, is_cross in zip(
                    self.single_type_managers, self.is_cross_attention, strict=True
                )
            ]
        )

    def cache_blocks(
        self, request: KVCacheRequest, num_tokens: int, shared_prefix_boundary: int = 0
    ) -> None:
        """Cache the full blocks of the first `num_tokens` tokens; a window group under a
        retention interval also keeps those a hit at `shared_prefix_boundary` reads."""
        for manager in self.single_type_managers:
            if manager.kv_cache_group_id in self._sparse_group_ids:
                cache_retained_blocks(
                    manager, request, num_tokens, self.retention_interval, shared_prefix_boundary
                )
            else:
                manager.cache_blocks(request, num_tokens)

    def free(self, req_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(req_id)

    def uncache_unwritten(self, req_id: str, num_written_tokens: int) -> None:
        """Every group's `uncache_unwritten` (single_type_manager.py)."""
        for manager in self.single_type_managers:
            manager.uncache_unwritten(req_id, num_written_tokens)

    def get_num_freed_by_skipping(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int
    ) -> int:
        """Blocks that `remove_skipped_blocks` would return to the free queue right now."""
        num_freed = 0
        for manager in self._skipping_managers:
            skipped = manager.get_skipped_blocks(req_id, num_computed_tokens, num_prompt_tokens)
            for block in skipped:
                if block.ref_cnt == 1:
                    num_freed += 1
        return num_freed

    def remove_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int
    ) -> None:
        """Null and free every group's blocks that the next token no longer reads.

        `num_prompt_tokens` matters only to R-SWA, whose manager also records it here.
        """
        for manager in self._skipping_managers:  # full attention never skips: not asked
            manager.remove_skipped_blocks(req_id, num_computed_tokens, num_prompt_tokens)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
        """Per group, the leading blocks of the request's table that every running request
        holds; 0 for groups whose attention does not read a plain shared prefix."""
        counts = [
            manager.get_num_common_prefix_blocks(running_request_id, num_running_requests)
            for manager in self.single_type_managers
        ]
        if self.block_holders and any(counts):
            # a holder's reference counts like a running request's: a run may not cross a
            # block a holder references, or it could pass one a running request lacks
            held = {block.block_id for holder in self.block_holders for block in holder()}
            for group_idx, manager in enumerate(self.single_type_managers):
                blocks = manager.req_to_blocks.get(running_request_id, [])
                for idx in range(counts[group_idx]):
                    if blocks[idx].block_id in held:
                        counts[group_idx] = idx
                        break
        return counts

    def get_blocks(self, req_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's whole table in every group (empty lists for an unknown request)."""
        return tuple(manager.req_to_blocks.get(req_id, []) for manager in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, int]:
        """The hit blocks per group and the hit length in tokens, touching nothing.

        `hit_source` answers the lookups in place of the pool: the tiers' TierHitView, whose
        TierHit stand-ins the KV-cache manager turns into device blocks at admission.
        """

    def find_longest_cache_hit_per_group(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, HitLengths]:
        """Each group's own longest hit within `max_cache_hit_length`, as if it were alone.

        No group shortens another's hit: a caller compares them (a group that hits further than
        full attention means full attention's tail was evicted). Touches nothing. With one
        group, or none that hits, that is the agreed hit.
        """
        hits, hit_length = self.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, hit_source
        )
        return hits, (hit_length,) * len(hits)

    def check_invariants(self) -> None:
        """Check the pool, every manager, and that ref counts match the request tables."""
        self.block_pool.check_invariants()
        num_refs = [0] * self.kv_cache_config.num_blocks
        for manager in self.single_type_managers:
            manager.check_invariants()
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        num_refs[block.block_id] += 1
        for holder in self.block_holders:
            for block in holder():
                num_refs[block.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == num_refs[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{num_refs[block.block_id]} request tables and holders list it"
            )


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, and never a hit."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsHook | None = None,
    ) -> None:
        super().__init__(kv_cache_config, False, enable_kv_cache_events, metrics_collector)
        self._no_hit: BlocksPerGroup = tuple(() for _ in self.single_type_managers)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, int]:
        return self._no_hit, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group: its manager's own hit is the answer."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsHook | None = None,
        retention_interval: int | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config, True, enable_kv_cache_events, metrics_collector, retention_interval
        )
        if len(self.single_type_managers) != 1:
            raise ValueError(
                f"UnitaryKVCacheCoordinator takes exactly one KV-cache group, "
                f"got {len(self.single_type_managers)}"
            )
        if self.is_cross_attention[0]:
            raise ValueError("the only KV-cache group is cross-attention: expected a decoder group")
        self._manager = self.single_type_managers[0]
        self._group_ids = [0]

    # The fan-out methods below call the one manager directly: they run for every request on
    # every step, and the loops of the general case cost more than the work itself.

    def get_num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        new_computed_blocks: BlocksPerGroup,
        num_encoder_tokens: int = 0,
    ) -> int:
        return self._manager.get_num_blocks_to_allocate(req_id, num_tokens, new_computed_blocks[0])

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: BlocksPerGroup, is_touched: bool = False
    ) -> None:
        blocks = new_computed_blocks[0]
        if blocks and not is_touched:
            self.block_pool.touch(blocks)
        self._manager.save_new_computed_blocks(req_id, blocks)

    def allocate_new_blocks(
        self, req_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks(req_id, num_tokens),)

    def cache_blocks(
        self, request: KVCacheRequest, num_tokens: int, shared_prefix_boundary: int = 0
    ) -> None:
        if self._sparse_group_ids:  # its one group is a window under a retention interval
            return super().cache_blocks(request, num_tokens)
        self._manager.cache_blocks(request, num_tokens)

    def free(self, req_id: str) -> None:
        self._manager.free(req_id)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, int]:
        manager = self._manager
        hits = manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self._group_ids,
            self.block_pool if hit_source is None else hit_source,
            manager.kv_cache_spec,
        )
        return hits, len(hits[0]) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups, such as full attention beside sliding windows, maybe of different block
    sizes over one `hash_block_size`; HybridHitSearch finds the hit every group agrees on.

    Cross-attention groups take no part in the search: their hit is always empty, and the
    decoder groups' hit stands alone. That is sound because a decoder block's hash covers the
    request's encoder input (Request hashes it into the first block's extra keys), and the
    workers compute every admitted request's encoder K/V anew. vLLM instead turns prefix
    caching off for encoder-decoder models.

    With mixed block sizes a group caches only the blocks within the request's tokens rounded
    down to the lcm of the block sizes, where every hit ends (as vLLM 0.33.0 does), and reads the
    request's hashes at its own block size.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsHook | None = None,
        retention_interval: int | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config, True, enable_kv_cache_events, metrics_collector, retention_interval
        )
        self.hit_search = HybridHitSearch(kv_cache_config, self.block_pool)
        self.hash_block_size = self.hit_search.hash_block_size
        self.alignment_tokens = self.hit_search.alignment_tokens
        self.has_mixed_block_sizes = self.hit_search.has_mixed_block_sizes
        if self.has_mixed_block_sizes:
            self.cache_alignment_tokens = self.alignment_tokens
        # With mixed sizes a window block that ends no hit on the lcm stays out of the index.
        self._window_group_ids = window_group_ids(kv_cache_config)

    def cache_blocks(
        self, request: KVCacheRequest, num_tokens: int, shared_prefix_boundary: int = 0
    ) -> None:
        if not self.has_mixed_block_sizes:
            return super().cache_blocks(request, num_tokens, shared_prefix_boundary)
        num_tokens = num_tokens // self.alignment_tokens * self.alignment_tokens
        for manager, is_cross in zip(
            self.single_type_managers, self.is_cross_attention, strict=True
        ):
            if is_cross:
                continue  # never cached, and its block size need not divide into hashes
            seen = request
            if manager.block_size != self.hash_block_size:
                seen = RequestAtBlockSize(request, self.hash_block_size, manager.block_size)
            if manager.kv_cache_group_id in self._window_group_ids:
                interval, junction = self.retention_interval, shared_prefix_boundary
                alignment = self.alignment_tokens
                cache_retained_blocks(manager, seen, num_tokens, interval, junction, alignment)
            else:
                manager.cache_blocks(seen, num_tokens)

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, int]:
        return self.hit_search.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, hit_source
        )

    def find_longest_cache_hit_per_group(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, HitLengths]:
        return self.hit_search.find_longest_cache_hit_per_group(
            block_hashes, max_cache_hit_length, hit_source
        )


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    enable_caching: bool,
    enable_kv_cache_events: bool = False,
    metrics_collector: BlockMetricsHook | None = None,
    retention_interval: int | None = None,
) -> KVCacheCoordinator:
    """No prefix cache when caching is off; Unitary for one group; Hybrid for several."""
    if not kv_cache_config.kv_cache_groups:
        raise ValueError("kv_cache_config has no KV-cache groups: expected at least one")
    validate_retention_interval(retention_interval, kv_cache_config)  # caching off too
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, enable_kv_cache_events, metrics_collector
        )
    args = (kv_cache_config, enable_kv_cache_events, metrics_collector, retention_interval)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(*args)
    return HybridKVCacheCoordinator(*args)
