"""KVCacheManager: the scheduler's one door to the KV cache (prefix hits, slots, frees, stats).

It turns token counts into block counts, keeps a failed allocation free of side effects, and
owns the prefix-cache totals. It never sizes memory and never talks to workers.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_metrics import BlockMetricsCollector
from engine_core.kv_cache.coordinator import BlocksPerGroup, get_kv_cache_coordinator
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.kv_tiers import KVTiers, describe_unsupported_tiers
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.kv_cache.spec import (
    PREFIX_ATTENTION_SPECS,
    KVCacheConfig,
    MambaSpec,
    RSWASpec,
    resolve_hash_block_size,
)
from engine_core.kv_cache.tier_hits import TierHit, replace_tier_hits
from protocol.kv_events import KVCacheEvent
from protocol.stats import BlockResidencyStats, PrefixCacheStats
from protocol.worker_messages import KVTransfers


@dataclass(slots=True, eq=False)
class KVCacheBlocks:
    """Blocks handed to one request by one call, one sequence per KV-cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]
    # Tokens of a prefix full attention hit past where a window group's retained blocks let the
    # agreed hit reach (vLLM's shared-prefix junction); 0 if none. A sum of blocks drops it.
    shared_prefix_boundary: int = 0
    # The request's hits are coming up from the disk tier: admit it a step later. (Hits in the
    # host tier are TierHit stand-ins in `blocks`, made device blocks at admission.)
    is_waiting_for_disk: bool = False

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(
            tuple([*mine, *theirs] for mine, theirs in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)


class KVCacheManager:
    """Prefix hits, slot allocation and freeing for the scheduler, over one shared BlockPool.

    Invariants: those of the coordinator (each non-null block's `ref_cnt` equals the number of
    request tables listing it) and of the BlockPool.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockMetricsCollector | None = None,
        prefix_cache_retention_interval: int | None = None,
        enable_shortcuts: bool = True,
    ) -> None:
        """One coordinator, and its BlockPool, for the groups of `kv_cache_config`.

        Args:
            enable_shortcuts: False sends every allocation through the general path
                (`allocate_slots`); the KV manager's state machine runs both and compares them.
        """
        # Requests hash at the gcd of the groups' block sizes; a larger group reads a view.
        expected_hash_block_size = resolve_hash_block_size(kv_cache_config.kv_cache_groups)
        if hash_block_size is not None and hash_block_size != expected_hash_block_size:
            block_sizes = sorted({g.spec.block_size for g in kv_cache_config.kv_cache_groups})
            raise ValueError(
                f"hash_block_size={hash_block_size} differs from {expected_hash_block_size}, "
                f"the gcd of the KV-cache block sizes {block_sizes}: expected them equal"
            )
        self.max_model_len = max_model_len
        self._hash_block_size = expected_hash_block_size
        self.enable_caching = enable_caching
        # None indexes every full block; an interval indexes a window group's blocks only where
        # a hit could start reading them: each interval's end and each prompt's replay boundary.
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            enable_caching,
            enable_kv_cache_events,
            metrics_collector,
            prefix_cache_retention_interval,
        )
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # Shared and never mutated: empty tuples, so no caller can append to it.
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self.metrics_collector = metrics_collector
        self._prefix_cache_stats = PrefixCacheStats()  # totals since start; readers get copies
        # With a retention interval or an align-mode Mamba group beside other groups, a lookup
        # also reports where the group searched first (full attention if any, as vLLM orders
        # them) hit on its own, and an admitted request keeps that junction: its window group
        # retains the blocks there, and the scheduler ends a Mamba chunk on it.
        groups = kv_cache_config.kv_cache_groups
        self._junction_group_id: int | None = None
        self._retains_at_junction = prefix_cache_retention_interval is not None
        has_align_mamba = any(
            isinstance(group.spec, MambaSpec) and group.spec.mamba_cache_mode == "align"
            for group in groups
        )
        if enable_caching and (self._retains_at_junction or has_align_mamba) and len(groups) > 1:
            specs = [group.spec for group in groups]
            full_ids = [
                idx for idx, spec in enumerate(specs) if isinstance(spec, PREFIX_ATTENTION_SPECS)
            ]
            self._junction_group_id = full_ids[0] if full_ids else 0
        self._shared_prefix_boundaries: dict[str, int] = {}  # req_id -> junction, in tokens
        # An R-SWA block past a request's prompt holds K/V computed as some other request's
        # prompt, which a generated token of this one would not have computed: no hit goes there.
        self.is_hit_capped_at_prompt = any(
            isinstance(group.spec, RSWASpec) for group in kv_cache_config.kv_cache_groups
        )
        # The shortcuts of `allocate_slots`, for a request that holds its tables and brings no
        # hits (every decode step): with one group that never skips blocks, its manager runs the
        # whole allocation; otherwise, a step that needs no block and fills none only hands
        # skipped blocks back.
        managers = self.coordinator.single_type_managers
        self._single_group_manager: SingleTypeKVCacheManager | None = None
        if enable_shortcuts and len(managers) == 1 and not managers[0].can_skip_blocks:
            self._single_group_manager = managers[0]
        self._tries_in_place = enable_shortcuts and self._single_group_manager is None
        # The tiers below the pool (DESIGN.md §3.5), with prefix caching only: nothing else
        # names a block's content.
        self.tiers: KVTiers | None = None
        if enable_caching and kv_cache_config.num_host_slots:
            self.tiers = self._make_tiers(kv_cache_config, enable_kv_cache_events)
        self._waiting_for_disk = KVCacheBlocks(
            self.empty_kv_cache_blocks.blocks, is_waiting_for_disk=True
        )

    def _make_tiers(self, kv_cache_config: KVCacheConfig, enable_kv_cache_events: bool) -> KVTiers:
        """The tiers' indexes, told of every eviction of the pool."""
        reason = describe_unsupported_tiers(kv_cache_config.kv_cache_groups)
        if reason is not None:
            raise ValueError(reason)
        pool = self.block_pool
        tiers = KVTiers(
            pool,
            kv_cache_config.num_host_slots,
            kv_cache_config.num_disk_slots,
            [group.spec.block_size for group in kv_cache_config.kv_cache_groups],
            self._prefix_cache_stats,
            pool.record_event if enable_kv_cache_events else None,
        )
        pool.eviction_listener = tiers.on_device_evict
        return tiers

    @property
    def usage(self) -> float:
        """The fraction of usable blocks held by requests, 0.0 to 1.0."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """A copy of the prefix-cache totals since start; calling it changes nothing."""
        return msgspec.structs.replace(self._prefix_cache_stats)

    def enable_block_metrics(self, sample_rate: float) -> None:
        """Time a `sample_rate` share of newly allocated blocks from now on."""
        self.metrics_collector = BlockMetricsCollector.from_sample_rate(sample_rate)
        self.block_pool.metrics_collector = self.metrics_collector

    def take_block_residency(self) -> BlockResidencyStats:
        """The sampled block timings since the last call; empty when block metrics are off."""
        if self.metrics_collector is None:
            return BlockResidencyStats()
        return self.metrics_collector.take_stats()

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a waiting request and its length in tokens.

        The hit stops at `num_tokens - 1`: the last token is always computed, for its logits.
        With an R-SWA group it also stops at the end of the prompt (a preempted request
        resumes with generated tokens past it). Nothing is touched; `allocate_slots` takes the
        references.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_hit_length = request.num_tokens - 1
        if self.is_hit_capped_at_prompt:
            max_hit_length = min(max_hit_length, request.num_prompt_tokens)
        hit_source = None
        tiers = self.tiers
        if tiers is not None:
            if tiers.is_awaiting_disk(request.req_id):
                return self._waiting_for_disk, 0
            hit_source = tiers.view(tiers.can_wait_for_disk(request.req_id))
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_hit_length, hit_source
        )
        if tiers is not None:
            tier_hits = [block for group in hits for block in group if isinstance(block, TierHit)]
            if any(hit.is_on_disk for hit in tier_hits):
                # Disk is not read in the step that needs it: its copy up goes out now, and
                # the request is admitted once the step's reply confirms it (a failed checksum
                # is then a miss, never a wrong token); if nothing could start, it computes.
                if tiers.promote(request.req_id, tier_hits):
                    return self._waiting_for_disk, 0
                hit_source = tiers.view(include_disk=False)
                hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
                    request.block_hashes, max_hit_length, hit_source
                )
        junction = 0
        if self._junction_group_id is not None:
            _, hit_lengths = self.coordinator.find_longest_cache_hit_per_group(
                request.block_hashes, max_hit_length, hit_source
            )
            longest = hit_lengths[self._junction_group_id]
            junction = longest if longest > num_hit_tokens else 0
        if not num_hit_tokens and not junction:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(hits, junction), num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` more tokens; the newly allocated blocks, or None.

        ```
        | computed | new computed (hits) | new tokens | lookahead |
                   |<-------------- blocks to allocate ---------->|
        |<------- cached once full ---------------->|
        ```
        None means the blocks do not fit; then no `ref_cnt` and no table has changed. When no
        new block was needed, it returns `empty_kv_cache_blocks` itself, so callers may test that
        by identity. `num_encoder_tokens` sizes a cross-attention group's table when the request
        is admitted (its whole encoder input at once); later calls may pass 0.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens={num_new_tokens} for {request.req_id}: expected >= 1")
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        num_scheduled_tokens = num_computed_tokens + num_new_tokens  # all but lookahead
        if new_computed_blocks is None:
            # Shortcuts for a request that holds its tables and brings no hits. Each returns
            # what `_allocate_in_every_group` would, leaving the same tables and pool; that
            # path stays the definition.
            single_group_manager = self._single_group_manager
            if single_group_manager is not None:
                if single_group_manager.has_request(request.req_id):
                    # One group that never skips: the general path is exactly the manager's
                    # count, allocate and cache, which `allocate_held` runs in one call.
                    new_held = single_group_manager.allocate_held(
                        request, num_tokens_need_slot, num_scheduled_tokens
                    )
                    if new_held is None:
                        return None
                    return KVCacheBlocks((new_held,)) if new_held else self.empty_kv_cache_blocks
            elif self._tries_in_place and self.coordinator.is_step_in_place(
                request,
                num_tokens_need_slot,
                min(num_scheduled_tokens, request.num_tokens),
                num_encoder_tokens,
            ):
                # Most decode steps: no group takes a block (so the room check passes) or caches
                # one, and only removing skipped blocks is left of the general path.
                self.coordinator.remove_skipped_blocks(
                    request.req_id, request.num_computed_tokens, request.num_prompt_tokens
                )
                return self.empty_kv_cache_blocks
        # Only real tokens are hashed: lookahead slots hold no known tokens yet.
        num_real_tokens = min(num_scheduled_tokens, request.num_tokens)
        return self._allocate_in_every_group(
            request,
            num_tokens_need_slot,
            num_real_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_encoder_tokens,
        )

    def _allocate_in_every_group(
        self,
        request: KVCacheRequest,
        num_tokens_need_slot: int,
        num_real_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_encoder_tokens: int,
    ) -> KVCacheBlocks | None:
        """`allocate_slots` through the coordinator, the general path that defines it: check the
        room, admit, remove skipped blocks, allocate and cache, in every group."""
        computed: BlocksPerGroup = (
            self.empty_kv_cache_blocks.blocks
            if new_computed_blocks is None
            else new_computed_blocks.blocks
        )
        req_id = request.req_id
        coordinator = self.coordinator
        tier_hits: list[TierHit] = []
        if self.tiers is not None and new_computed_blocks is not None:
            tier_hits = [
                block for group in computed for block in group if isinstance(block, TierHit)
            ]
            # Read last in the step: this allocation's evictions must spare their host slots.
            self.tiers.pin_host_slots(hit.tier_slot for hit in tier_hits)
        if not self._can_allocate(request, num_tokens_need_slot, computed, num_encoder_tokens):
            return None
        if not coordinator.has_request(req_id):
            if tier_hits:  # device blocks for them, filled from the host tier in this step
                assert self.tiers is not None
                num_host_tokens, num_disk_tokens = self.tiers.count_admitted_hits(
                    request.req_id, computed
                )
                self._prefix_cache_stats.host_hits += num_host_tokens
                self._prefix_cache_stats.disk_hits += num_disk_tokens
                computed = replace_tier_hits(
                    self.block_pool,
                    request,
                    computed,
                    self.tiers.block_sizes,
                    self._hash_block_size,
                    self.tiers.copy_in,
                )
            self._admit(request, num_new_computed_tokens, computed, is_touched=bool(tier_hits))
            if new_computed_blocks is not None and new_computed_blocks.shared_prefix_boundary:
                self._shared_prefix_boundaries[req_id] = new_computed_blocks.shared_prefix_boundary
        elif new_computed_blocks is not None:
            coordinator.save_new_computed_blocks(req_id, computed)  # empty, or it raises
        # After admission, so an R-SWA group records the prompt length before caching any block.
        coordinator.remove_skipped_blocks(
            req_id, request.num_computed_tokens, request.num_prompt_tokens
        )
        new_blocks = coordinator.allocate_new_blocks(
            req_id, num_tokens_need_slot, num_encoder_tokens
        )
        if self.enable_caching:
            junction = (
                self._shared_prefix_boundaries.get(req_id, 0) if self._retains_at_junction else 0
            )
            coordinator.cache_blocks(request, num_real_tokens, junction)
        if not any(new_blocks):
            return self.empty_kv_cache_blocks  # most decode steps: the last block has room
        return KVCacheBlocks(new_blocks)

    def _can_allocate(
        self,
        request: KVCacheRequest,
        num_tokens: int,
        computed: BlocksPerGroup,
        num_encoder_tokens: int,
    ) -> bool:
        """Whether slots up to `num_tokens` fit, counting evictable hits as consumed."""
        coordinator = self.coordinator
        num_blocks = coordinator.get_num_blocks_to_allocate(
            request.req_id, num_tokens, computed, num_encoder_tokens
        )
        num_free_blocks = self.block_pool.get_num_free_blocks()
        if num_blocks <= num_free_blocks:
            return True
        # Out-of-window blocks go back to the pool before allocating, and may make the room.
        num_freed = coordinator.get_num_freed_by_skipping(
            request.req_id, request.num_computed_tokens, request.num_prompt_tokens
        )
        return num_blocks <= num_free_blocks + num_freed

    def _admit(
        self,
        request: KVCacheRequest,
        num_hit_tokens: int,
        computed: BlocksPerGroup,
        is_touched: bool = False,
    ) -> None:
        """Start the tables of a request that holds none, with its hits, and count its lookup.

        Stats count here rather than at lookup, so a request that waits for room is counted
        once, not on every step it is looked up.
        """
        if self.enable_caching:
            stats = self._prefix_cache_stats
            if request.num_preemptions:
                stats.preempted_requests += 1
                stats.preempted_queries += request.num_tokens
                stats.preempted_hits += num_hit_tokens
            else:
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_hit_tokens
        self.coordinator.save_new_computed_blocks(request.req_id, computed, is_touched)

    def free(self, request: KVCacheRequest, num_written_tokens: int | None = None) -> None:
        """Release every block of the request, tail first in each group.

        Args:
            num_written_tokens: the tokens whose K/V the ranks hold or will write, when fewer
                than the request's cached blocks cover (it was unscheduled from the step being
                planned); blocks cached past them leave the prefix-cache index first.
        """
        if num_written_tokens is not None and self.enable_caching:
            self.coordinator.uncache_unwritten(request.req_id, num_written_tokens)
        self._shared_prefix_boundaries.pop(request.req_id, None)
        self.coordinator.free(request.req_id)
        if self.tiers is not None:
            self.tiers.forget_request(request.req_id)

    def get_shared_prefix_boundary(self, req_id: str) -> int:
        """The junction an admitted request's lookup reported (KVCacheBlocks), 0 if none."""
        return self._shared_prefix_boundaries.get(req_id, 0)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's whole block table, one id list per group."""
        return tuple(
            [block.block_id for block in blocks] for blocks in self.coordinator.get_blocks(req_id)
        )

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> list[int]:
        """Per group, how many leading blocks of `running_request_id`'s table all
        `num_running_requests` running requests share (a full-attention block whose `ref_cnt`
        is their number); 0 for groups other than full attention.

        Exact only while every request that holds blocks is among the running ones.
        """
        return self.coordinator.get_num_common_prefix_blocks(
            running_request_id, num_running_requests
        )

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache and the tiers below it; False (with a logged reason) while a
        request holds blocks."""
        if self.tiers is not None and self.block_pool.reset_refusal_reason() is None:
            self.tiers.clear()  # its BlockRemoved events go out before AllBlocksCleared
        if not self.block_pool.reset_prefix_cache():
            return False
        self._prefix_cache_stats.resets += 1
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def take_kv_transfers(self, step_id: int) -> KVTransfers | None:
        """The tier copies of step `step_id`, planned by its allocations; None if none."""
        if self.tiers is None:
            return None
        return self.tiers.take_transfers(step_id)

    def on_step_reply(self, step_id: int, failed_disk_slots: bytes) -> None:
        """Confirm a step's disk copies: a slot that failed on any rank becomes a miss."""
        if self.tiers is not None:
            self.tiers.on_step_reply(step_id, failed_disk_slots)

    def check_invariants(self) -> None:
        self.coordinator.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants()
        if self.metrics_collector is not None:
            self.metrics_collector.check_invariants()
