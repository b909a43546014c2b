"""MambaManager: the blocks of recurrent-state (Mamba) groups, which hold one state per request
rather than K/V per token.

Like every SingleTypeKVCacheManager it asks the shared BlockPool for blocks and never decides
across groups. It never sees a state's values; the worker reads and writes them.
"""

from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.kv_cache.spec import KVCacheSpec, MambaSpec, cdiv
from engine_core.kv_cache.tier_hits import HitSource

# What vLLM 0.33.0 does (MambaManager, MambaSpec, Scheduler._mamba_block_aligned_split), and
# where kvserve differs on purpose:
# - Align mode: the state after t tokens at position cdiv(t, block_size) - 1, skipped positions
#   null, one new block per step that crosses a boundary, the previous state block returned once
#   the next step begins, hits scanned right to left for the last cached state, and a hit on a
#   state cached by the step being scheduled deferred a step (both).
# - Mode none: vLLM sets the group's block_size to max_model_len so a request spans one block;
#   kvserve keeps the model's block size (one hash block size for every group) and holds one.
#   vLLM refuses a prefix cache without align mode; kvserve serves it and never hits (a hybrid
#   then hits nothing), and runs align mode without a prefix cache as one block (no checkpoint
#   could ever be read).
# - vLLM caches every full block of a chunk, trusting aligned chunks; kvserve caches only the
#   block that holds its own boundary's state, so a chunk ending mid-block never publishes one.
# - vLLM clears the hashes cached "this step" at each step start; kvserve needs no step hook: a
#   checkpoint is pending while its publisher's computed tokens (advanced once a step is
#   planned) fall short of it, and a pending one is evicted if its publisher is freed.
# - vLLM ignores lookahead slots in align mode; kvserve's scheduler reserves none beside such a
#   group, and cache_blocks refuses a table grown past the step.
# - Not built: speculative-decoding blocks, partial-block hits with copy-on-write, sparse
#   retention of Mamba checkpoints, and checkpoints written inside a chunk.


class MambaManager(SingleTypeKVCacheManager):
    """State blocks of a Mamba group, in the reference's two modes.

    Mode "none" (and "align" without a prefix cache, where a checkpoint could never be hit):
    each request holds one block, its running state, updated in place by every step and never
    cached.

    Mode "align": position i of a table stands for the state after `(i + 1) * block_size`
    tokens, and the state after `t` computed tokens lives at position `cdiv(t, block_size) - 1`.
    A step that crosses a block boundary gets one new block at the position of its last token
    (the worker carries the state there from the step's starting block), and the positions it
    skips are null: their states were never materialised. A block is cached only when it holds
    the state at its own boundary, so a hit is one block, found by scanning right to left:

    ```
    block 4, chunks 0..8 and 8..10:  | null | ckpt@8 | state@10 |   (ckpt@8 cached, hit-able)
    next step, from 10 on:           | null | null   | state@10 |   (ckpt@8 back to the pool)
    ```

    The block a step starts from is returned (null in the table) once the next step has
    begun, so a request holds at most two blocks. The scheduler ends every chunk of a prefill
    on a block boundary, except its last, so that each boundary state is written exactly.

    Invariants, beside the base class's: in one-block mode a table holds at most one block
    and no null; in align mode a table holds at most two non-null blocks, its last block is
    non-null, and its first `num_retired_block[req_id]` positions are null.
    """

    can_skip_leading_blocks = True
    can_skip_blocks = True

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError(f"MambaManager needs a MambaSpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.is_align = kv_cache_spec.mamba_cache_mode == "align" and block_pool.enable_caching
        # Leading positions of each table known to be null, so skip scans start after them.
        self.num_retired_block: dict[str, int] = {}
        # Checkpoints published by the step now being scheduled, by block id: the publisher and
        # the token count its state needs. Until the publisher's computed tokens reach that
        # count, the state is not yet written when a same-step reader would load it.
        self._pending_checkpoints: dict[int, tuple[KVCacheRequest, int]] = {}
        self._pending_block_ids: dict[str, int] = {}  # the one pending checkpoint per request

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """The last cached state within `max_length` tokens, after null blocks; none in mode none.

        The scan runs right to left and stops at the first hit: only the state at the hit's
        end is needed, not the states before it.
        """
        assert isinstance(kv_cache_spec, MambaSpec)
        no_hit: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        if kv_cache_spec.mamba_cache_mode != "align":
            return no_hit
        num_blocks = min(max_length // kv_cache_spec.block_size, len(block_hashes))
        for idx in range(num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[idx], kv_cache_group_ids)
            if cached is not None:
                return tuple([block_pool.null_block] * idx + [block] for block in cached)
        return no_hit

    def get_num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """One block when the table must reach a new position, plus hits now sitting evictable.

        A hit on a checkpoint that this very step publishes asks for more blocks than the pool
        has: its state is written by the same step that would read it, so the request waits a
        step (the reference defers it the same way).
        """
        if new_computed_blocks and self._is_pending(new_computed_blocks[-1]):
            return self.block_pool.num_gpu_blocks + 1
        num_held = len(self.req_to_blocks.get(req_id, ())) + len(new_computed_blocks)
        if self.is_align:
            num_new = int(cdiv(num_tokens, self.block_size) > num_held)
        else:
            num_new = int(num_held == 0)
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new + num_evictable

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        is_new = req_id not in self.num_cached_block
        super().save_new_computed_blocks(req_id, new_computed_blocks)
        if is_new:
            self.num_retired_block[req_id] = max(len(new_computed_blocks) - 1, 0)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The null blocks and the one new block that bring the table to `num_tokens`.

        The nulls are returned too: the worker appends them, so positions stay aligned.
        """
        blocks = self.req_to_blocks[req_id]
        if not self.is_align:
            if blocks:
                return []
            blocks.extend(self.block_pool.get_new_blocks(1))
            return list(blocks)
        num_required = cdiv(num_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
        added = [self.null_block] * (num_required - 1 - len(blocks))
        added += self.block_pool.get_new_blocks(1)
        blocks.extend(added)
        return added

    def is_step_in_place(
        self, request: KVCacheRequest, num_tokens: int, num_real_tokens: int
    ) -> bool:
        """In align mode as for any group (one position per block, the boundary blocks cached);
        in one-block mode whenever the request holds its block, which never grows or caches."""
        req_id = request.req_id
        blocks = self.req_to_blocks.get(req_id)
        if not self.is_align:
            return bool(blocks)
        # The base class's answer (align mode always caches), without a super() call per step.
        if blocks is None or len(blocks) * self.block_size < num_tokens:
            return False
        return self.num_cached_block[req_id] >= num_real_tokens // self.block_size

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache the block of the state after `num_tokens`, if that is a block boundary.

        Other positions up to there hold no boundary state: they are null, or hold the state a
        chunk ending mid-block left (the last chunk of a prompt), which no hit may read.
        """
        if not self.is_align:
            return
        req_id = request.req_id
        blocks = self.req_to_blocks[req_id]
        num_full = num_tokens // self.block_size
        # One more position than the known tokens fill is the slot of an asynchronous step's
        # placeholder token; any more means slots were given for tokens beyond this chunk.
        if len(blocks) > cdiv(num_tokens, self.block_size) + 1:
            raise ValueError(
                f"request {req_id} holds {len(blocks)} state blocks in group "
                f"{self.kv_cache_group_id} for {num_tokens} tokens: align mode allocates only "
                f"for the tokens of the step, never lookahead"
            )
        if num_full <= self.num_cached_block[req_id]:
            return
        self.num_cached_block[req_id] = num_full
        if num_tokens % self.block_size or blocks[num_full - 1].is_null:
            return
        self.block_pool.cache_full_blocks(
            request, blocks, num_full - 1, num_full, self.block_size, self.kv_cache_group_id
        )
        self._forget_pending(req_id)
        block_id = blocks[num_full - 1].block_id
        self._pending_checkpoints[block_id] = (request, num_tokens)
        self._pending_block_ids[req_id] = block_id

    def free(self, req_id: str) -> None:
        """Release the request's blocks, tail first; a checkpoint its dropped step would have
        written leaves the prefix cache first (a preempted request's planned step never runs).
        """
        self.num_retired_block.pop(req_id, None)
        pending = self._forget_pending(req_id)
        if pending is not None:
            block_id, (publisher, num_tokens) = pending
            if publisher.num_computed_tokens < num_tokens:
                self.block_pool.evict_blocks([block_id])
        super().free(req_id)

    def get_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> list[KVCacheBlock]:
        """The blocks before the current state's position that are not yet null, tail first."""
        if not self.is_align:
            return []
        blocks = self.req_to_blocks.get(req_id, [])
        end_idx = min(cdiv(num_computed_tokens, self.block_size) - 1, len(blocks))
        start_idx = self.num_retired_block.get(req_id, 0)
        return [
            blocks[idx] for idx in range(end_idx - 1, start_idx - 1, -1) if not blocks[idx].is_null
        ]

    def remove_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Null and free the states before the one the next step starts from, tail first."""
        skipped = self.get_skipped_blocks(req_id, num_computed_tokens)
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None or not self.is_align:
            return
        end_idx = min(cdiv(num_computed_tokens, self.block_size) - 1, len(blocks))
        for idx in range(self.num_retired_block[req_id], end_idx):
            blocks[idx] = self.null_block
        self.num_retired_block[req_id] = max(self.num_retired_block[req_id], end_idx)
        if skipped:
            self.block_pool.free_blocks(skipped)

    def _is_pending(self, block: KVCacheBlock) -> bool:
        """Whether the block is a checkpoint whose publisher's step is still being scheduled."""
        pending = self._pending_checkpoints.get(block.block_id)
        if pending is None:
            return False
        publisher, num_tokens = pending
        # The scheduler advances a request's computed tokens once its step is planned.
        return publisher.num_computed_tokens < num_tokens

    def _forget_pending(self, req_id: str) -> tuple[int, tuple[KVCacheRequest, int]] | None:
        """Drop the request's last published checkpoint from the pending map; return it."""
        block_id = self._pending_block_ids.pop(req_id, None)
        pending = self._pending_checkpoints.get(block_id) if block_id is not None else None
        # The block may since have been reused and published again by another request.
        if block_id is None or pending is None or pending[0].req_id != req_id:
            return None
        del self._pending_checkpoints[block_id]
        return block_id, pending

    def check_null_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        """See the class docstring for where null blocks may be."""
        real = [block for block in blocks if not block.is_null]
        if not self.is_align:
            assert len(blocks) <= 1 and len(real) == len(blocks), (
                f"{req_id} holds {[block.block_id for block in blocks]} in one-block Mamba "
                f"group {self.kv_cache_group_id}"
            )
            return
        num_retired = self.num_retired_block[req_id]
        assert len(real) <= 2 and (not blocks or not blocks[-1].is_null), (
            f"{req_id} holds {[block.block_id for block in blocks]} in Mamba group "
            f"{self.kv_cache_group_id}: expected at most two states, the last one live"
        )
        assert all(block.is_null for block in blocks[:num_retired]), (
            f"{req_id} in Mamba group {self.kv_cache_group_id}: a state before position "
            f"{num_retired}, which is retired"
        )
