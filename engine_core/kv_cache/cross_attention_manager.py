"""CrossAttentionManager: the per-request encoder K/V blocks of an encoder-decoder model.

Like every SingleTypeKVCacheManager it asks the shared BlockPool for blocks and never decides
across groups. It never hashes a block and never offers a prefix hit.
"""

from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.kv_cache.spec import CrossAttentionSpec, KVCacheSpec
from engine_core.kv_cache.tier_hits import HitSource


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Every decoder token of a request reads the K/V of all its encoder tokens, so the request
    holds `cdiv(num_encoder_tokens, block_size)` blocks from admission until it is freed:

    ```
    decoder tokens:  | prompt | generated ... |   (other groups: the table grows)
    encoder blocks:  | enc 0 | enc 1 | enc 2 |    (this group: fixed at admission)
    ```

    The coordinator passes the encoder token count, not the decoder's, as `num_tokens`: at
    admission it allocates every encoder block, and later calls (count 0) allocate nothing.

    Encoder K/V depend on the whole encoder input, which no block hash of decoder tokens covers,
    so nothing here is ever cached: no hit, no hash, no entry in the prefix-cache index (as in
    vLLM). A preempted request loses its blocks like any other and is given new ones when it is
    admitted again; the workers then recompute the encoder.

    Invariants, beside the base class's: no request holds a null block, `num_cached_block` is 0
    for every request, and no block of this group carries a block hash.
    """

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        if not isinstance(kv_cache_spec, CrossAttentionSpec):
            raise TypeError(
                f"CrossAttentionManager needs a CrossAttentionSpec, got {kv_cache_spec}"
            )
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)

    def save_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Start the request's (empty) table: encoder blocks are never a prefix hit."""
        if new_computed_blocks:
            raise ValueError(
                f"request {req_id} brings {len(new_computed_blocks)} computed blocks to "
                f"cross-attention group {self.kv_cache_group_id}: expected none, it is never cached"
            )
        super().save_new_computed_blocks(req_id, new_computed_blocks)

    def is_step_in_place(
        self, request: KVCacheRequest, num_tokens: int, num_real_tokens: int
    ) -> bool:
        """Whether the table holds `num_tokens` encoder slots; nothing here is ever cached."""
        blocks = self.req_to_blocks.get(request.req_id)
        return blocks is not None and len(blocks) * self.block_size >= num_tokens

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Nothing to publish: encoder blocks never enter the prefix-cache index."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Never a hit. A hybrid coordinator does not ask this group at all, so that it never
        limits the decoder groups' hit (see HybridKVCacheCoordinator)."""
        return tuple([] for _ in kv_cache_group_ids)

    def check_invariants(self) -> None:
        super().check_invariants()
        for req_id, blocks in self.req_to_blocks.items():
            assert self.num_cached_block[req_id] == 0, (
                f"{req_id} caches {self.num_cached_block[req_id]} blocks in cross-attention "
                f"group {self.kv_cache_group_id}"
            )
            hashed = [block.block_id for block in blocks if block.block_hash is not None]
            assert not hashed, (
                f"{req_id} holds hashed blocks {hashed} in cross-attention group "
                f"{self.kv_cache_group_id}"
            )
