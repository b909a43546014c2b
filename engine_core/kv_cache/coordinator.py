"""KV-cache coordinators: one BlockPool shared by every KV-cache group, one manager per group.

A coordinator fans each request operation out to the per-group managers and, for prefix hits,
decides one hit length that every group can honour. It never hashes tokens or sizes memory.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_metrics import BlockMetricsHook
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.cross_attention_manager import CrossAttentionManager
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.retention import (
    cache_retained_blocks,
    sparse_retention_group_ids,
    validate_retention_interval,
)
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    make_single_type_manager,
    spec_manager_class,
)
from engine_core.kv_cache.spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
)

BlocksPerGroup = tuple[Sequence[KVCacheBlock], ...]  # one block list per KV-cache group
HitLengths = tuple[int, ...]  # one hit length in tokens per KV-cache group


class KVCacheCoordinator(ABC):
    """Runs each request operation over every group's manager, against one shared BlockPool.

    Invariants: each group's manager holds its own invariants, and every non-null block's
    `ref_cnt` equals the number of request tables, over all groups, that list it.
    """

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
        # Full attention never skips blocks, and is never asked to.
        managers = self.single_type_managers
        self._skipping_managers = tuple(
            manager for manager in managers if type(manager) is not FullAttentionManager
        )
        self.can_skip_blocks = bool(self._skipping_managers)
        # Cross-attention groups size their tables by the encoder's tokens, not the decoder's.
        self.is_cross_attention = tuple(
            isinstance(manager, CrossAttentionManager) for manager in self.single_type_managers
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

    def save_new_computed_blocks(self, req_id: str, new_computed_blocks: BlocksPerGroup) -> None:
        """Touch every group's hits, then start the request's tables with them.

        All hits are touched before any new block is allocated, so the allocation of one group
        can never evict the hit blocks of another.
        """
        if self.enable_caching:
            for blocks in new_computed_blocks:
                if blocks:
                    self.block_pool.touch(blocks)
        for manager, blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(req_id, blocks)

    def has_request(self, req_id: str) -> bool:
        """Whether the request holds a table (it was allocated and not freed since)."""
        return req_id in self.single_type_managers[0].num_cached_block

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

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        for manager in self.single_type_managers:
            if manager.kv_cache_group_id in self._sparse_group_ids:
                cache_retained_blocks(manager, request, num_tokens, self.retention_interval)
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
        return [
            manager.get_num_common_prefix_blocks(running_request_id, num_running_requests)
            for manager in self.single_type_managers
        ]

    def get_blocks(self, req_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's whole table in every group (empty lists for an unknown request)."""
        return tuple(manager.req_to_blocks.get(req_id, []) for manager in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        """The hit blocks per group and the hit length in tokens, touching nothing."""

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, HitLengths]:
        """Each group's own longest hit, as if it were alone (a group hitting further than full
        attention means full attention's tail was evicted); with one group, the agreed hit."""
        hits, hit_length = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)
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
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == num_refs[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{num_refs[block.block_id]} request tables list it"
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
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
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

    def save_new_computed_blocks(self, req_id: str, new_computed_blocks: BlocksPerGroup) -> None:
        blocks = new_computed_blocks[0]
        if blocks:
            self.block_pool.touch(blocks)
        self._manager.save_new_computed_blocks(req_id, blocks)

    def allocate_new_blocks(
        self, req_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks(req_id, num_tokens),)

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        if self._sparse_group_ids:  # its one group is a window under a retention interval
            return super().cache_blocks(request, num_tokens)
        self._manager.cache_blocks(request, num_tokens)

    def free(self, req_id: str) -> None:
        self._manager.free(req_id)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        manager = self._manager
        hits = manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self._group_ids,
            self.block_pool,
            manager.kv_cache_spec,
        )
        return hits, len(hits[0]) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups of one block size, such as full attention beside sliding windows.

    Groups with equal specs search together. Full attention searches first: its hit only ever
    shrinks by truncation, so it gives the others a tight upper bound.

    Cross-attention groups take no part in the search: their hit is always empty, and the
    decoder groups' hit stands alone. That is sound because a decoder block's hash covers the
    request's encoder input (Request hashes it into the first block's extra keys), and the
    workers compute every admitted request's encoder K/V anew. vLLM instead turns prefix
    caching off for encoder-decoder models.
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
        block_sizes = sorted({manager.block_size for manager in self.single_type_managers})
        if len(block_sizes) != 1:
            raise ValueError(f"KV-cache groups use block sizes {block_sizes}: expected one")
        self.block_size = block_sizes[0]
        self.spec_groups = _group_ids_by_spec(kv_cache_config)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, int]:
        """Shrink the hit length until every group hits at least that far (a fixed point).

        Each pass asks every spec group for its hit within the current length; the length can
        only fall, so the loop ends, and when a pass changes nothing every group agrees.
        """
        block_size = self.block_size
        hit_length = max_cache_hit_length // block_size * block_size
        hits: list[Sequence[KVCacheBlock]] = [()] * len(self.single_type_managers)
        searched_full: set[KVCacheSpec] = set()
        while True:
            pass_length = hit_length
            for spec, group_ids in self.spec_groups:
                if spec in searched_full:
                    # A full-attention hit is a prefix: a shorter hit is its truncation.
                    for group_id in group_ids:
                        hits[group_id] = hits[group_id][: pass_length // block_size]
                    continue
                manager_cls = spec_manager_class(spec)
                found = manager_cls.find_longest_cache_hit(
                    block_hashes, pass_length, group_ids, self.block_pool, spec
                )
                for group_id, group_hits in zip(group_ids, found, strict=True):
                    hits[group_id] = group_hits
                pass_length = len(found[0]) * block_size
                if isinstance(spec, FullAttentionSpec):
                    searched_full.add(spec)
            if pass_length == hit_length:
                break
            hit_length = pass_length
        num_hit_blocks = hit_length // block_size
        return tuple(group_hits[:num_hit_blocks] for group_hits in hits), hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[BlocksPerGroup, HitLengths]:
        """One search per spec group (groups of one spec hit together), none bounding another."""
        hits: list[Sequence[KVCacheBlock]] = [()] * len(self.single_type_managers)
        hit_lengths = [0] * len(self.single_type_managers)
        for spec, group_ids in self.spec_groups:
            found = spec_manager_class(spec).find_longest_cache_hit(
                block_hashes, max_cache_hit_length, group_ids, self.block_pool, spec
            )
            for group_id, group_hits in zip(group_ids, found, strict=True):
                hits[group_id] = group_hits
                hit_lengths[group_id] = len(group_hits) * self.block_size
        return tuple(hits), tuple(hit_lengths)


def _group_ids_by_spec(kv_cache_config: KVCacheConfig) -> list[tuple[KVCacheSpec, list[int]]]:
    """Group ids sharing one spec, full attention first, otherwise in order of first group id."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not isinstance(group.spec, CrossAttentionSpec):  # never a hit, never a limit
            by_spec.setdefault(group.spec, []).append(group_id)
    return sorted(by_spec.items(), key=lambda item: not isinstance(item[0], FullAttentionSpec))


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
