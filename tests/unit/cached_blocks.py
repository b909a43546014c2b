"""Block pools holding cached, free blocks in a chosen pattern, for the managers' and the
coordinator's hit-scan tests: block hashes are made up, no request or tokens stand behind them."""

from collections.abc import Sequence
from types import SimpleNamespace

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.hashing import BlockHash


def block_hashes(num_blocks: int) -> list[BlockHash]:
    return [BlockHash(bytes([idx]) * 8) for idx in range(num_blocks)]


def cache_then_free(
    pool: BlockPool,
    hashes: list[BlockHash],
    cached: Sequence[bool],
    block_size: int,
    group_id: int = 0,
) -> None:
    """Cache fresh blocks under `hashes[i]` in group `group_id` where `cached[i]`, then free."""
    blocks = pool.get_new_blocks(len(hashes))
    stand_in = SimpleNamespace(req_id="setup", block_hashes=hashes)
    for idx, is_cached in enumerate(cached):
        if is_cached:
            pool.cache_full_blocks(stand_in, blocks, idx, idx + 1, block_size, group_id)
    pool.free_blocks(blocks[::-1])


def pool_with_cached(
    pattern: str, block_size: int, num_spare_blocks: int = 4
) -> tuple[BlockPool, list[BlockHash]]:
    """A pool where block i + 1 is cached under hash i wherever `pattern[i]` is '1', then freed."""
    pool = BlockPool(num_gpu_blocks=len(pattern) + num_spare_blocks, enable_caching=True)
    hashes = block_hashes(len(pattern))
    cache_then_free(pool, hashes, [mark == "1" for mark in pattern], block_size)
    return pool, hashes
