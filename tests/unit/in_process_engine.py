"""Engines whose executor is a real ModelRunner in this process, for the tests that join the
engine's Scheduler to the worker's runner without sockets: the engine config and the runner."""

import torch

from protocol.config import CacheConfig, EngineConfig, SchedulerConfig
from protocol.kv_cache_spec import KVCacheConfig
from worker.distributed import single_rank_group
from worker.kv_cache import allocate_kv_caches
from worker.model_runner import ModelRunner
from worker.models.registry import build_model


def engine_config(
    block_size: int, check_invariants: bool = True, **scheduler_fields: object
) -> EngineConfig:
    """A checked config with prefix caching on and the given scheduler fields."""
    return EngineConfig(
        check_invariants=check_invariants,
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(**scheduler_fields),  # type: ignore[arg-type]
    ).checked()


def model_runner(
    model: str,
    kv_cache_config: KVCacheConfig,
    device: torch.device,
    max_model_len: int,
    **options: object,
) -> ModelRunner:
    """The runner of a one-rank group over freshly allocated caches, checking every step."""
    return ModelRunner(
        build_model(model, single_rank_group(), device),
        kv_cache_config,
        allocate_kv_caches(kv_cache_config, 1, device),
        0,
        max_model_len,
        device,
        check_each_step=True,
        **options,  # type: ignore[arg-type]
    )
