"""Per-group managers for attention kinds that stop reading earlier tokens: chunked local
attention (earlier chunks) and R-SWA (generated tokens between the prompt and the decode window).

Like every SingleTypeKVCacheManager they ask the shared BlockPool for blocks and never decide
across groups.
"""

from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash
from engine_core.kv_cache.kv_request import KVCacheRequest
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)
from engine_core.kv_cache.spec import ChunkedLocalAttentionSpec, KVCacheSpec, RSWASpec, cdiv
from engine_core.kv_cache.tier_hits import HitSource


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention reads only the current chunk of `attention_chunk_size` tokens.

    Blocks wholly inside earlier chunks are handed back to the pool once the request has
    computed past them, and a hit needs only the cached blocks of the current chunk.
    """

    can_skip_leading_blocks = True
    can_skip_blocks = True

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise TypeError(
                f"ChunkedLocalAttentionManager needs a ChunkedLocalAttentionSpec, "
                f"got {kv_cache_spec}"
            )
        # A chunk that starts mid-block would leave its first tokens in a block that a hit
        # returns as null; vLLM's chunked-local kernels refuse such sizes too.
        if kv_cache_spec.attention_chunk_size % kv_cache_spec.block_size:
            raise ValueError(
                f"attention_chunk_size={kv_cache_spec.attention_chunk_size} is not a multiple of "
                f"block_size={kv_cache_spec.block_size}"
            )
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: HitSource,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Null blocks up to the chunk of token `max_length`, then the cached run from there.

        Token `max_length` (the next one to compute) reads only its own chunk, so every block
        wholly before that chunk counts as computed without a lookup:

        ```
        chunk 8, block 4, max_length 15:  | null | null | hit? |  . . . |
                                          |<- chunk 0 ->|<-- chunk 1 -->|
        ```
        """
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        block_size = kv_cache_spec.block_size
        num_blocks = min(max_length // block_size, len(block_hashes))
        chunk_start = max_length // kv_cache_spec.attention_chunk_size
        chunk_start *= kv_cache_spec.attention_chunk_size
        num_null = min(chunk_start // block_size, num_blocks)
        null_block = block_pool.null_block
        hits = tuple([null_block] * num_null for _ in kv_cache_group_ids)
        for idx in range(num_null, num_blocks):
            cached = block_pool.get_cached_block(block_hashes[idx], kv_cache_group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits

    def get_num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks that end before the chunk of the next token (position `num_computed_tokens`)."""
        chunk_size = self.attention_chunk_size
        return num_computed_tokens // chunk_size * chunk_size // self.block_size


class RSWAManager(FullAttentionManager):
    """R-SWA: every token reads the whole prompt; a generated one also reads the last
    `rswa_window` tokens before it. Generated tokens between the prompt and that window (the gap)
    are never read again, so their blocks become the null block and go back to the pool:

    ```
    | prompt (kept) | gap (null) | window | next token |
                    ^ cdiv(num_prompt_tokens, block_size)
    ```

    A hit is a full-attention prefix, but only prompt blocks are ever cached: a generated token's
    K/V depends on which tokens were its prompt, so it is not the K/V a later prompt of the same
    tokens would compute.

    Invariants, beside the base class's: a request's null blocks form one run that starts at or
    after block `cdiv(num_prompt_tokens, block_size)`, and no request caches a block past its
    prompt. A table without a known prompt length holds no null block and publishes no
    block to the prefix cache (its hits stay).
    """

    can_skip_blocks = True  # the gap's blocks; never leading ones

    def __init__(
        self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int
    ) -> None:
        if not isinstance(kv_cache_spec, RSWASpec):
            raise TypeError(f"RSWAManager needs an RSWASpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.rswa_window = kv_cache_spec.rswa_window
        # Each held request's prompt length, learned from remove_skipped_blocks.
        self.num_prompt_tokens: dict[str, int] = {}

    def get_num_common_prefix_blocks(
        self, running_request_id: str, num_running_requests: int
    ) -> int:
        """0: a generated token reads a window beside the prompt, not a plain shared prefix."""
        return 0

    def is_step_in_place(
        self, request: KVCacheRequest, num_tokens: int, num_real_tokens: int
    ) -> bool:
        """As for full attention, but only the prompt's blocks are ever cached (`cache_blocks`)."""
        num_cacheable_tokens = min(num_real_tokens, request.num_prompt_tokens)
        return super().is_step_in_place(request, num_tokens, num_cacheable_tokens)

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache the full blocks of the first `num_tokens` tokens that lie wholly in the prompt."""
        num_prompt_tokens = self.num_prompt_tokens.get(request.req_id, 0)
        num_prompt_tokens -= num_prompt_tokens % self.block_size
        super().cache_blocks(request, min(num_tokens, num_prompt_tokens))

    def free(self, req_id: str) -> None:
        self.num_prompt_tokens.pop(req_id, None)
        super().free(req_id)

    def get_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> list[KVCacheBlock]:
        """The gap blocks not yet replaced by the null block, tail first.

        The gap is the blocks wholly inside `[num_prompt_tokens, num_computed_tokens -
        rswa_window)`; without a prompt length (given now or recorded before) it is empty.
        """
        if num_prompt_tokens is None:
            num_prompt_tokens = self.num_prompt_tokens.get(req_id)
            if num_prompt_tokens is None:
                return []
        blocks = self.req_to_blocks.get(req_id, [])
        first_gap_idx = cdiv(num_prompt_tokens, self.block_size)
        window_start = max(num_prompt_tokens, num_computed_tokens - self.rswa_window)
        end_idx = min(window_start // self.block_size, len(blocks))
        skipped: list[KVCacheBlock] = []
        for idx in range(end_idx - 1, first_gap_idx - 1, -1):
            block = blocks[idx]
            if block.is_null:
                break  # an earlier call replaced this one and the gap before it
            skipped.append(block)
        return skipped

    def remove_skipped_blocks(
        self, req_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Record the prompt length of a held request, then null and free its gap, tail first."""
        if num_prompt_tokens is not None and req_id in self.req_to_blocks:
            recorded = self.num_prompt_tokens.setdefault(req_id, num_prompt_tokens)
            if recorded != num_prompt_tokens:
                raise ValueError(
                    f"request {req_id} in group {self.kv_cache_group_id}: prompt of "
                    f"{num_prompt_tokens} tokens, expected the {recorded} recorded before"
                )
        skipped = self.get_skipped_blocks(req_id, num_computed_tokens, num_prompt_tokens)
        if not skipped:
            return
        blocks = self.req_to_blocks[req_id]
        if num_prompt_tokens is None:
            num_prompt_tokens = self.num_prompt_tokens[req_id]
        window_start = max(num_prompt_tokens, num_computed_tokens - self.rswa_window)
        end_idx = min(window_start // self.block_size, len(blocks))
        for idx in range(end_idx - len(skipped), end_idx):
            blocks[idx] = self.null_block
        self.block_pool.free_blocks(skipped)

    def check_null_blocks(self, req_id: str, blocks: list[KVCacheBlock]) -> None:
        """Null blocks form one run after the prompt's blocks; none without a prompt length."""
        num_prompt_tokens = self.num_prompt_tokens.get(req_id)
        if num_prompt_tokens is not None:
            num_cached = self.num_cached_block[req_id]
            assert num_cached <= num_prompt_tokens // self.block_size, (
                f"{req_id} in group {self.kv_cache_group_id} caches {num_cached} blocks, past "
                f"its {num_prompt_tokens}-token prompt"
            )
        null_idxs = [idx for idx, block in enumerate(blocks) if block.is_null]
        if not null_idxs:
            return
        assert num_prompt_tokens is not None, (
            f"{req_id} holds null blocks {null_idxs} in R-SWA group {self.kv_cache_group_id} "
            f"without a known prompt length"
        )
        first_gap_idx = cdiv(num_prompt_tokens, self.block_size)
        assert null_idxs[0] >= first_gap_idx, (
            f"{req_id} in group {self.kv_cache_group_id}: null block at {null_idxs[0]} inside "
            f"its {num_prompt_tokens}-token prompt"
        )
        assert null_idxs[-1] - null_idxs[0] + 1 == len(null_idxs), (
            f"{req_id} in group {self.kv_cache_group_id}: null blocks {null_idxs} are not one run"
        )
