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
from engine_core.kv_cache.local_attention_managers import ChunkedLocalAttentionManager, RSWAManager
from engine_core.kv_cache.mamba_manager import MambaManager
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from engine_core.kv_cache.spec import (
    PREFIX_ATTENTION_SPECS,
    KVCacheConfig,
    MambaSpec,
    RSWASpec,
    resolve_hash_block_size,
)
from protocol.kv_events import KVCacheEvent
from protocol.stats import BlockResidencyStats, PrefixCacheStats

# Managers that do nothing on a step that needs no new block and fills none, but skip blocks.
# A Mamba group qualifies in align mode (a step inside a block neither moves nor publishes its
# state); in one-block mode its table never holds the sequence's slots, so the check fails.
IN_PLACE_MANAGER_TYPES = (
    FullAttentionManager,
    SlidingWindowManager,
    ChunkedLocalAttentionManager,
    RSWAManager,
    MambaManager,
)


@dataclass(slots=True, eq=False)
class KVCacheBlocks:
    """Blocks handed to one request by one call, one sequence per KV-cache group."""

    blocks: tuple[Sequence[KVCacheBlock], ...]
    # Tokens of a prefix full attention hit past where a window group's retained blocks let the
    # agreed hit reach (vLLM's shared-prefix junction); 0 if none. A sum of blocks drops it.
    shared_prefix_boundary: int = 0

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
    ) -> None:
        # Requests hash at the gcd of the groups' block sizes; a larger group reads a view.
        expected_hash_block_size = resolve_hash_block_size(kv_cache_config.kv_cache_groups)
        if hash_block_size is not None and hash_block_size != expected_hash_block_size:
            block_sizes = sorted({g.spec.block_size for g in kv_cache_config.kv_cache_groups})
            raise ValueError(
                f"hash_block_size={hash_block_size} differs from {expected_hash_block_size}, "
                f"the gcd of the KV-cache block sizes {block_sizes}: expected them equal"
            )
        self.max_model_len = max_model_len
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
        # With one group that never skips blocks, a request that holds a table and brings no
        # hits (every decode step) needs no fan-out: its one manager grows it in one call.
        managers = self.coordinator.single_type_managers
        self._held_manager: SingleTypeKVCacheManager | None = (
            managers[0] if len(managers) == 1 and not self.coordinator.can_skip_blocks else None
        )
        # With several such groups, most decode steps need no new block and fill none: they
        # only hand skipped blocks back (`_is_step_in_place`), without the per-group fan-out.
        is_in_place = all(type(manager) in IN_PLACE_MANAGER_TYPES for manager in managers)
        self._in_place_managers = managers if len(managers) > 1 and is_in_place else ()

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
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_hit_length
        )
        junction = 0
        if self._junction_group_id is not None:
            _, hit_lengths = self.coordinator.find_longest_cache_hit_per_group(
                request.block_hashes, max_hit_length
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
        held_manager = self._held_manager
        if new_computed_blocks is None and held_manager is not None:
            blocks = held_manager.req_to_blocks.get(request.req_id)
            if blocks is not None:
                new_held = held_manager.allocate_held(
                    request, blocks, num_tokens_need_slot, num_computed_tokens + num_new_tokens
                )
                if new_held is None:
                    return None
                # Most decode steps: the last block has room, and nothing new is handed out.
                return KVCacheBlocks((new_held,)) if new_held else self.empty_kv_cache_blocks
        # Only real tokens are hashed: lookahead slots hold no known tokens yet.
        num_real_tokens = min(num_computed_tokens + num_new_tokens, request.num_tokens)
        if (
            new_computed_blocks is None
            and self._in_place_managers
            and self._is_step_in_place(request, num_tokens_need_slot, num_real_tokens)
        ):
            self.coordinator.remove_skipped_blocks(
                request.req_id, request.num_computed_tokens, request.num_prompt_tokens
            )
            return self.empty_kv_cache_blocks
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
        """`allocate_slots` through the coordinator: admit, skip, allocate and cache per group."""
        computed: BlocksPerGroup = (
            self.empty_kv_cache_blocks.blocks
            if new_computed_blocks is None
            else new_computed_blocks.blocks
        )
        req_id = request.req_id
        coordinator = self.coordinator
        if not self._can_allocate(request, num_tokens_need_slot, computed, num_encoder_tokens):
            return None
        if not coordinator.has_request(req_id):
            self._admit(request, num_new_computed_tokens, computed)
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

    def _is_step_in_place(
        self, request: KVCacheRequest, num_tokens: int, num_real_tokens: int
    ) -> bool:
        """Whether the request's table in every group holds `num_tokens` slots already and has
        cached every block its first `num_real_tokens` tokens fill (R-SWA: those of the prompt);
        then `allocate_slots` would only hand skipped blocks back."""
        req_id, is_caching = request.req_id, self.enable_caching
        alignment = self.coordinator.cache_alignment_tokens  # caching stops on its multiples
        num_real_tokens = num_real_tokens // alignment * alignment
        for manager in self._in_place_managers:
            blocks = manager.req_to_blocks.get(req_id)
            if blocks is None or len(blocks) * manager.block_size < num_tokens:
                return False
            if is_caching:
                num_cacheable_tokens = num_real_tokens
                if type(manager) is RSWAManager:
                    num_cacheable_tokens = min(num_real_tokens, request.num_prompt_tokens)
                if manager.num_cached_block[req_id] < num_cacheable_tokens // manager.block_size:
                    return False
        return True

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
        self, request: KVCacheRequest, num_hit_tokens: int, computed: BlocksPerGroup
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
        self.coordinator.save_new_computed_blocks(request.req_id, computed)

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
        """Clear the prefix cache; False (with a logged reason) while a request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._prefix_cache_stats.resets += 1
        return True

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def check_invariants(self) -> None:
        self.coordinator.check_invariants()
        if self.metrics_collector is not None:
            self.metrics_collector.check_invariants()
