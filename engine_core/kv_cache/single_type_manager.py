"""Per-group block tables: which blocks each request holds in one KV-cache group, and its hits.

A SingleTypeKVCacheManager knows one attention kind. It asks the shared BlockPool for blocks and
never decides across groups; that is the coordinator's job.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.spec import (
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from engine_core.kv_cache.tier_hits import HitSource


class SingleTypeKVCacheManager(ABC):
    """Every request's blocks in one KV-cache group, in token order.

    Invariants:
    1. Each non-null block a request lists is in use (`ref_cnt > 0`), and no request lists the
       same non-null block twice.
    2. `num_cached_block[req_id] <= len(req_to_blocks[req_id])`, and both dicts hold the same
       requests.
    3. Null blocks appear only where the manager skips blocks (`check_null_blocks`): as a prefix
       of a request's list in sliding-window and chunked-local groups, never in full attention.
    """

    can_skip_leading_blocks = False  # whether blocks before the attention span become null
    can_skip_blocks = False  # whether remove_skipped_blocks can ever free a block of this kind

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request whose hashes are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks this allocation consumes: the new ones, plus hits now sitting evictable.

        A hit block with `ref_cnt == 0` is still in the free queue; touching it takes it out, so
        it counts against the free blocks just like a freshly allocated one.
        """
        num_held = len(self.req_to_blocks.get(req_id, ()))
        num_required = -(-num_tokens // self.block_size)  # cdiv, inlined on this hot path
        num_new = num_required - len(new_computed_blocks) - num_held
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new + num_evictable if num_new > 0 else num_evictable

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start a request's table with its (already touched) prefix hits."""
        if req_id in self.num_cached_block:
            if new_computed_blocks:
                raise ValueError(
                    f"request {req_id} already holds blocks in group {self.kv_cache_group_id}: "
                    f"expected no new computed blocks, got {len(new_computed_blocks)}"
                )
            return
        self.req_to_blocks[req_id] = list(new_computed_blocks)
        self.num_cached_block[req_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to hold `num_tokens` tokens; return the blocks it took."""
        blocks = self.req_to_blocks[req_id]
        num_new = -(-num_tokens // self.block_size) - len(blocks)  # cdiv, inlined
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def has_request(self, req_id: str) -> bool:
        """Whether the request holds a table here (it was allocated and not freed since)."""
        return req_id in self.num_cached_block

    def is_step_in_place(
        self, request: KVCacheRequest, num_tokens: int, num_real_tokens: int
    ) -> bool:
        """Whether `allocate_new_blocks(req_id, num_tokens)` and `cache_blocks(request,
        num_real_tokens)` would change nothing: the table holds `num_tokens` slots already, and
        (with caching on) every block its first `num_real_tokens` tokens fill is cached.

        False for a request that holds no table. Kinds that grow or cache otherwise answer for
        themselves.
        """
        req_id = request.req_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None or len(blocks) * self.block_size < num_tokens:
            return False
        if not self.block_pool.enable_caching:
            return True
        return self.num_cached_block[req_id] >= num_real_tokens // self.block_size

    def allocate_held(
        self, request: KVCacheRequest, num_tokens: int, num_scheduled_tokens: int
    ) -> Sequence[KVCacheBlock] | None:
        """The coordinator's whole allocation for a request that holds a table and brings no
        hits, in a group that never skips blocks; the blocks it took, or None if they do not fit.

        It is `get_num_blocks_to_allocate(req_id, num_tokens, ())` checked against the free
        blocks, then `allocate_new_blocks(req_id, num_tokens)` and, with caching on,
        `cache_blocks(request, num_real_tokens)`, where `num_real_tokens` is the known tokens
        among the first `num_scheduled_tokens` (computed plus new: no lookahead). That is all
        the coordinator runs for such a request (`remove_skipped_blocks` never asks a group that
        cannot skip). Most steps need neither a block nor a cache entry, so those two calls,
        and the count of known tokens, are made only when they would act.
        """
        req_id = request.req_id
        block_size = self.block_size
        # get_num_blocks_to_allocate with no hits: only the new blocks count.
        num_new = -(-num_tokens // block_size) - len(self.req_to_blocks[req_id])  # cdiv, inlined
        new_blocks: Sequence[KVCacheBlock] = ()
        if num_new > 0:
            if num_new > self.block_pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = self.allocate_new_blocks(req_id, num_tokens)
        # With no block filled past the cached ones, cache_blocks would return at once.
        if (
            num_scheduled_tokens // block_size > self.num_cached_block[req_id]
            and self.block_pool.enable_caching
        ):
            self.cache_blocks(request, min(num_scheduled_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Hash and publish the request's blocks that the first `num_tokens` tokens fill."""
        req_id = request.req_id
        num_cached = self.num_cached_block[req_id]
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[req_id],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
        )
        self.num_cached_block[req_id] = num_full

    def uncache_unwritten(self, req_id: str, num_written_tokens: int) -> None:
        """Drop from the prefix-cache index the request's blocks cached past its first
        `num_written_tokens` tokens that no other request holds: their K/V will never be written.

        A request unscheduled from the step being planned (a preemption victim scheduled earlier
        in it) had its full blocks cached when they were allocated; left in the index, a later
        request would hit pages no rank ever wrote.
        """
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        first = num_written_tokens // self.block_size  # the first block not wholly written
        unwritten = [
            block.block_id
            for block in blocks[first:]
            if block.block_hash is not None and block.ref_cnt == 1
        ]
        if unwritten:
            self.block_pool.evict_blocks(unwritten)
        self.num_cached_block[req_id] = min(self.num_cached_block.get(req_id, 0), first)

    def free(self, req_id: str) -> None:
        """Release the request's blocks tail first, so its prefix's tail is evicted first."""
        self.num_cached_block.pop(req_id, None)
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that the next token's attention never reads; none for full attention."""
        return 0

    def get_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> list[KVCacheBlock]:
        """The request's skipped blocks not yet replaced by the null block, tail first.

        Args:
            num_prompt_tokens: the request's prompt length, for attention kinds whose span
                depends on it (R-SWA); the others ignore it.
        """
        num_skipped = self.get_num_skipped_blocks(num_computed_tokens)
        if num_skipped == 0:
            return []
        blocks = self.req_to_blocks.get(req_id, [])
        skipped: list[KVCacheBlock] = []
        for idx in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            block = blocks[idx]
            if block.is_null:
                break  # an earlier call replaced this one and everything before it
            skipped.append(block)
        return skipped

    def remove_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Replace the skipped blocks with the null block and free them, tail first."""
        skipped = self.get_skipped_blocks(req_id, num_computed_tokens, num_prompt_tokens)
        if not skipped:
            return
        blocks = self.req_to_blocks[req_id]
        end_idx = min(self.get_num_skipped_blocks(num_computed_tokens), len(blocks))
        for idx in range(end_idx - len(skipped), end_idx):
            blocks[idx] = self.null_block
        self.block_pool.free_blocks(skipped)

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> int:
        """Leading blocks of the request's table that every running request shares.

        Only plain full attention reads a shared prefix the same way for every request, so
        every other kind answers 0.
        """
        return 0

    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The cached blocks of the longest usable prefix of at most `max_length` tokens.

        Returns one list per group id, all the same length; a group of the same spec is a hit
        only where every listed group hits.
        """

    def check_invariants(self) -> None:
        """Walk every request's table (see the class docstring)."""
        assert self.req_to_blocks.keys() == self.num_cached_block.keys(), (
            f"group {self.kv_cache_group_id}: tables for {sorted(self.req_to_blocks)} but "
            f"cached counts for {sorted(self.num_cached_block)}"
        )
        for req_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_block[req_id]
            assert num_cached <= len(blocks), (
                f"{req_id} in group {self.kv_cache_group_id}: {num_cached} cached of "
                f"{len(blocks)} blocks"
            )
            self.check_null_blocks(req_id, blocks)
            real = [block for block in blocks if not block.is_null]
            assert len({block.block_id for block in real}) == len(real), (
                f"{req_id} lists a block twice in group {self.kv_cache_group_id}: "
                f"{[block.block_id for block in real]}"
            )
            for block in real:
                assert block.ref_cnt > 0, (
                    f"{req_id} holds block {block.block_id} with ref_cnt {block.ref_cnt}"
                )

    def check_null_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        """Null blocks form a prefix of the table, and only where leading blocks are skipped."""
        num_null = sum(1 for block in blocks if block.is_null)
        assert all(block.is_null for block in blocks[:num_null]), (
            f"{req_id} in group {self.kv_cache_group_id}: null blocks are not a prefix"
        )
        assert self.can_skip_leading_blocks or not num_null, (
            f"{req_id} holds {num_null} null blocks in group {self.kv_cache_group_id}, "
            f"which never skips blocks"
        )


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention reads every earlier token, so a hit is an unbroken run from token 0."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Scan left to right and stop at the first block that misses in any group."""
        num_blocks = min(max_length // kv_cache_spec.block_size, len(block_hashes))
        if len(kv_cache_group_ids) == 1:
            return (block_pool.get_cached_prefix(block_hashes, num_blocks, kv_cache_group_ids[0]),)
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        get_cached_block = block_pool.get_cached_block
        for idx in range(num_blocks):
            cached = get_cached_block(block_hashes[idx], kv_cache_group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> int:
        """Leading blocks held by every running request: each one's `ref_cnt` is their number.

        A block is shared only through a prefix hit, at the same position in every table, so
        while all holders are running this is the run of positions where all tables agree.
        """
        num_common = 0
        for block in self.req_to_blocks.get(running_request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention reads only the last `sliding_window` tokens.

    A hit needs only the blocks that window covers, and blocks wholly before the window are
    handed back to the pool as soon as the request has computed past them.
    """

    can_skip_leading_blocks = True
    can_skip_blocks = True

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise TypeError(f"SlidingWindowManager needs a SlidingWindowSpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Scan right to left for a run of cached blocks long enough to cover the window.

        The next token attends to the `sliding_window - 1` tokens before it, which span
        `cdiv(sliding_window - 1, block_size)` blocks. Blocks before the run are the null block.
        A run that reaches block 0 is a hit even when it is shorter.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        num_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        num_blocks = min(max_length // block_size, len(block_hashes))
        null_block = block_pool.null_block
        hits = tuple([null_block] * num_blocks for _ in kv_cache_group_ids)
        num_contiguous = 0
        for idx in range(num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[idx], kv_cache_group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits[idx] = block
            num_contiguous += 1
            if num_contiguous >= num_needed:
                num_hit_blocks = idx + num_contiguous
                return tuple(group_hits[:num_hit_blocks] for group_hits in hits)
        # No run long enough: only a run starting at block 0 is usable.
        return tuple(group_hits[:num_contiguous] for group_hits in hits)

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks that end before the window of the next token.

        The next token (position `num_computed_tokens`) reads positions from
        `num_computed_tokens - sliding_window + 1` on; every block wholly before that is dead.
        """
        num_skipped_tokens = num_computed_tokens - self.sliding_window + 1
        return max(num_skipped_tokens, 0) // self.block_size
