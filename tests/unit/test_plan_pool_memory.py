"""The engine states its block pool's host memory and refuses, before any rank allocates, a pool
whose bookkeeping would pass --max-pool-host-memory-bytes, naming --num-gpu-blocks-override."""

import logging

import pytest

from engine_core.service.plan import POOL_HOST_BYTES_PER_BLOCK, plan_engine
from protocol.config import CacheConfig, EngineConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from protocol.worker_messages import ModelInfo

GROUPS = [KVCacheGroupSpec(["layers.0"], FullAttentionSpec(4, 2, 8, "float32"))]
MODEL = ModelInfo("tiny", 64, [], 32, GROUPS)


def _config(limit_blocks: int | None, override: int | None = None) -> EngineConfig:
    limit = None if limit_blocks is None else limit_blocks * POOL_HOST_BYTES_PER_BLOCK
    cache = CacheConfig(block_size=4, num_gpu_blocks_override=override)
    return EngineConfig(tp_size=2, cache=cache, max_pool_host_memory_bytes=limit).checked()


def test_a_pool_past_its_host_memory_limit_is_refused_naming_the_override() -> None:
    """A tiny model on a large GPU asks for tens of millions of blocks of bookkeeping."""
    with pytest.raises(
        ValueError,
        match=r"a pool of 101 blocks needs about 12120 bytes .*--num-gpu-blocks-override "
        r"\(at most 100 blocks\)",
    ):
        plan_engine(_config(100), MODEL, [101, 200])
    assert plan_engine(_config(100), MODEL, [100, 200]).kv_cache_config.num_blocks == 100


def test_the_override_brings_a_huge_pool_under_the_limit() -> None:
    plan = plan_engine(_config(1000, override=1000), MODEL, [50_000_000, 60_000_000])
    assert plan.kv_cache_config.num_blocks == 1000


def test_without_a_limit_the_pool_is_only_stated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine_core.service.plan"):
        plan = plan_engine(_config(None), MODEL, [50_000_000, 60_000_000])
    assert plan.kv_cache_config.num_blocks == 50_000_000
    assert "pool of 50000000 blocks takes about 5722.0 MiB of host memory" in caplog.text
