"""The KVCacheManager state machine over chunked local attention, alone and beside full attention.

It reuses the engine-path machine (allocate_slots, preemption, reset) and changes only what a
token reads and where a hit may hold the null block.
"""

from array import array

from test_kv_cache_manager_state_machine import FULL, STEP_SETTINGS, KVCacheManagerMachine

from engine_core.kv_cache.hashing import make_block_hash_with_group_id
from engine_core.kv_cache.manager import KVCacheBlocks
from engine_core.kv_cache.spec import ChunkedLocalAttentionSpec, KVCacheSpec
from engine_core.sched.request import Request

BLOCK_SIZE = 2
CHUNKED = ChunkedLocalAttentionSpec(
    block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32", attention_chunk_size=6
)


class ChunkedLocalKVCacheManagerMachine(KVCacheManagerMachine):
    specs = (CHUNKED,)
    num_blocks = 16

    def _check_attention_reads(
        self, request: Request, table: list[int], pos: int, spec: KVCacheSpec
    ) -> None:
        """Token `pos` reads its own chunk up to itself, or every token before it (full)."""
        first_read = 0
        if isinstance(spec, ChunkedLocalAttentionSpec):
            first_read = pos // spec.attention_chunk_size * spec.attention_chunk_size
        for read_pos in range(first_read, pos + 1):
            block_id = table[read_pos // BLOCK_SIZE]
            found = self.slots.get(block_id, [None] * BLOCK_SIZE)[read_pos % BLOCK_SIZE]
            assert block_id != 0 and found == request.all_token_ids[read_pos], (
                f"{request.req_id} token {pos} reads token {read_pos} from block {block_id}: "
                f"found {found}, expected {request.all_token_ids[read_pos]}"
            )

    def _check_hits(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        """Real hit blocks hold the right tokens; null ones lie before the next token's chunk."""
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens < request.num_tokens
        tokens = request.all_token_ids
        for group_id, blocks in enumerate(hits.blocks):
            assert len(blocks) == num_hit_tokens // BLOCK_SIZE
            spec = self.specs[group_id]
            for idx, block in enumerate(blocks):
                if block.is_null:
                    assert isinstance(spec, ChunkedLocalAttentionSpec)
                    chunk_start = num_hit_tokens // spec.attention_chunk_size
                    assert (idx + 1) * BLOCK_SIZE <= chunk_start * spec.attention_chunk_size
                    continue
                key = make_block_hash_with_group_id(request.block_hashes[idx], group_id)
                assert block.block_hash == key
                expected = array("i", tokens[idx * BLOCK_SIZE : (idx + 1) * BLOCK_SIZE]).tolist()
                assert self.slots[block.block_id] == expected, (
                    f"false hit: block {block.block_id} holds {self.slots[block.block_id]}, "
                    f"{request.req_id} expects {expected}"
                )


class HybridChunkedLocalKVCacheManagerMachine(ChunkedLocalKVCacheManagerMachine):
    specs = (FULL, CHUNKED)
    num_blocks = 30


TestChunkedLocalKVCacheManagerMachine = ChunkedLocalKVCacheManagerMachine.TestCase
TestChunkedLocalKVCacheManagerMachine.settings = STEP_SETTINGS
TestHybridChunkedLocalKVCacheManagerMachine = HybridChunkedLocalKVCacheManagerMachine.TestCase
TestHybridChunkedLocalKVCacheManagerMachine.settings = STEP_SETTINGS
