"""HybridHitSearch: the one prefix-hit length every KV-cache group of a hybrid model can honour.

Groups may differ in block size over one `hash_block_size`; each group reads the request's hashes
at its own block size, and every hit length lands on the lcm of the block sizes. It touches no
block and never allocates.
"""

import math
from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash, BlockHashListWithBlockSize, get_hash_block_size
from engine_core.kv_cache.spec import (
    PREFIX_ATTENTION_SPECS,
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
)
from engine_core.kv_cache.spec_managers import spec_manager_class
from engine_core.kv_cache.tier_hits import HitSource

BlocksPerGroup = tuple[Sequence[KVCacheBlock], ...]  # one block list per KV-cache group
HitLengths = tuple[int, ...]  # one hit length in tokens per KV-cache group


class HybridHitSearch:
    """Finds hits over several groups, full attention first, sharing one BlockPool.

    Groups with equal specs search together. Full attention searches first: its hit only ever
    shrinks by truncation, so it gives the others a tight upper bound. Cross-attention groups
    take no part: their hit is always empty (see HybridKVCacheCoordinator).

    Every hit length is a multiple of `alignment_tokens`, the lcm of the searching groups' block
    sizes, so each group's hit ends on one of its own block boundaries (vLLM 0.33.0 aligns its
    hybrid hits to this lcm too, outside its Mamba-only fine-grained mode). With one block size
    the alignment is that size and every view is the request's own list.

    Invariants: `hash_block_size` divides every searching group's block size, and
    `alignment_tokens` is a multiple of each.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.num_groups = len(kv_cache_config.kv_cache_groups)
        self.spec_groups = _group_ids_by_spec(kv_cache_config)
        block_sizes = [spec.block_size for spec, _ in self.spec_groups]
        self.hash_block_size = get_hash_block_size(block_sizes)
        self.alignment_tokens = math.lcm(*block_sizes)
        self.has_mixed_block_sizes = self.alignment_tokens != self.hash_block_size

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, int]:
        """Shrink the hit length until every group hits at least that far (a fixed point).

        Each pass asks every spec group for its aligned hit within the current length; the
        length can only fall, so the loop ends, and when a pass changes nothing every group
        agrees. `hit_source` answers the lookups (the pool; with tiers, a TierHitView, so that
        tier hits count in every group by that group's rule).
        """
        views = self._views(block_hashes)
        alignment = self.alignment_tokens
        hit_length = max_cache_hit_length // alignment * alignment
        hits: list[Sequence[KVCacheBlock]] = [()] * self.num_groups
        searched_full: set[KVCacheSpec] = set()
        while True:
            pass_length = hit_length
            for (spec, group_ids), hashes in zip(self.spec_groups, views, strict=True):
                if spec in searched_full:
                    # A full-attention hit is a prefix: a shorter hit is its truncation.
                    for group_id in group_ids:
                        hits[group_id] = hits[group_id][: pass_length // spec.block_size]
                    continue
                found, pass_length = self._find_aligned(
                    spec, group_ids, hashes, pass_length, hit_source
                )
                for group_id, group_hits in zip(group_ids, found, strict=True):
                    hits[group_id] = group_hits
                if isinstance(spec, PREFIX_ATTENTION_SPECS):
                    searched_full.add(spec)
            if pass_length == hit_length:
                break
            hit_length = pass_length
        lengths = [0] * self.num_groups
        for spec, group_ids in self.spec_groups:
            for group_id in group_ids:
                lengths[group_id] = hit_length // spec.block_size
        return tuple(h[:n] for h, n in zip(hits, lengths, strict=True)), hit_length

    def find_longest_cache_hit_per_group(
        self,
        block_hashes: Sequence[BlockHash],
        max_cache_hit_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[BlocksPerGroup, HitLengths]:
        """One aligned search per spec group (groups of one spec hit together), none bounding
        another."""
        hits: list[Sequence[KVCacheBlock]] = [()] * self.num_groups
        hit_lengths = [0] * self.num_groups
        views = self._views(block_hashes)
        for (spec, group_ids), hashes in zip(self.spec_groups, views, strict=True):
            found, length = self._find_aligned(
                spec, group_ids, hashes, max_cache_hit_length, hit_source
            )
            for group_id, group_hits in zip(group_ids, found, strict=True):
                hits[group_id] = group_hits
                hit_lengths[group_id] = length
        return tuple(hits), tuple(hit_lengths)

    def _views(self, block_hashes: Sequence[BlockHash]) -> list[Sequence[BlockHash]]:
        """The request's hashes at each spec group's block size (the list itself where equal;
        a snapshot of the view elsewhere, which the scans index far faster than the view)."""
        hash_block_size = self.hash_block_size
        return [
            block_hashes
            if spec.block_size == hash_block_size
            else BlockHashListWithBlockSize(
                block_hashes, hash_block_size, spec.block_size
            ).snapshot()
            for spec, _ in self.spec_groups
        ]

    def _find_aligned(
        self,
        spec: KVCacheSpec,
        group_ids: list[int],
        block_hashes: Sequence[BlockHash],
        max_length: int,
        hit_source: HitSource | None = None,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The spec group's longest hit within `max_length` that ends on `alignment_tokens`.

        A full-attention hit is truncated to the alignment. Another kind's hit at a shorter
        length needs other blocks (a window reads the blocks just before its end), so it is
        searched again within the aligned length until it ends aligned: each search's bound
        stays above the longest aligned hit, so that is the one found.
        """
        manager_cls = spec_manager_class(spec)
        block_size, alignment = spec.block_size, self.alignment_tokens
        source = self.block_pool if hit_source is None else hit_source
        while True:
            found = manager_cls.find_longest_cache_hit(
                block_hashes, max_length, group_ids, source, spec
            )
            length = len(found[0]) * block_size
            aligned = length // alignment * alignment
            if aligned == length:
                return found, length
            if isinstance(spec, PREFIX_ATTENTION_SPECS):
                num_blocks = aligned // block_size
                return tuple(group_hits[:num_blocks] for group_hits in found), aligned
            max_length = aligned


def _group_ids_by_spec(kv_cache_config: KVCacheConfig) -> list[tuple[KVCacheSpec, list[int]]]:
    """Group ids sharing one spec, full attention first, otherwise in order of first group id."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if not isinstance(group.spec, CrossAttentionSpec):  # never a hit, never a limit
            by_spec.setdefault(group.spec, []).append(group_id)
    return sorted(by_spec.items(), key=lambda item: not isinstance(item[0], PREFIX_ATTENTION_SPECS))
