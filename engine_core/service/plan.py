"""EnginePlan: everything the engine decides once at startup from its config and the ranks' hellos
(the KV-cache layout and num_blocks, the scheduler's limits, a one-line capacity summary). Every
startup check lives here, once; no sockets.
"""

import logging
from dataclasses import dataclass

from engine_core.kv_cache.kv_tiers import describe_unsupported_tiers
from engine_core.kv_cache.spec import KVCacheGroupSpec, describe_capacity, plan_kv_cache
from engine_core.kv_transfer.layout import (
    describe_unauthenticated_nixl,
    describe_unsupported_layout,
    nixl_available,
)
from engine_core.sched.limits import SchedulerLimits, resolve_limits
from protocol.config import CacheConfig, EngineConfig
from protocol.kv_cache_spec import KVCacheConfig, bytes_per_block
from protocol.worker_messages import ModelInfo

logger = logging.getLogger(__name__)

# Host memory of the pool's bookkeeping per block (KVCacheBlock, its free-queue links, its slot
# in the block list), measured: a BlockPool of 1,000,000 blocks took 120.4 bytes per block, both
# in tracemalloc's count and in the process's resident memory (CPython 3.11).
POOL_HOST_BYTES_PER_BLOCK = 120


class FlagValueError(ValueError):
    """A flag's value that cannot work with the model the ranks loaded: a usage error (exit 2)
    that only the handshake can find, its message naming the flag."""


@dataclass(frozen=True, slots=True)
class EnginePlan:
    kv_cache_config: KVCacheConfig  # sent to every rank, and the pool's size
    limits: SchedulerLimits
    num_blocks_per_rank: list[int]  # what each rank's memory holds, before taking the minimum
    summary: str  # "KV cache holds N tokens; max concurrency X at max_model_len L"


def plan_engine(
    config: EngineConfig, model_info: ModelInfo, num_blocks_per_rank: list[int]
) -> EnginePlan:
    """The plan, or ValueError naming the settings that cannot work together."""
    if len(num_blocks_per_rank) != config.tp_size:
        raise ValueError(
            f"got capacities of {len(num_blocks_per_rank)} ranks: "
            f"expected one per rank of tp_size={config.tp_size}"
        )
    kv_cache_config = plan_kv_cache(
        model_info.kv_cache_groups, num_blocks_per_rank, config.cache.num_gpu_blocks_override
    )
    num_host_slots, num_disk_slots = plan_tier_slots(
        config.cache, kv_cache_config.kv_cache_groups, config.tp_size
    )
    kv_cache_config = KVCacheConfig(
        kv_cache_config.num_blocks,
        kv_cache_config.kv_cache_groups,
        check_invariants=config.check_invariants,  # the ranks walk theirs when the engine does
        num_host_slots=num_host_slots,
        num_disk_slots=num_disk_slots,
        disk_dir=config.cache.kv_offload_disk_dir if num_disk_slots else None,
        kv_transfer_address=config.kv_transfer_address if config.kv_role == "prefill" else None,
        kv_transport=ranks_kv_transport(config),
    )
    check_kv_role(config, kv_cache_config)
    check_pool_host_memory(kv_cache_config.num_blocks, config.max_pool_host_memory_bytes)
    limits = resolve_limits(config.scheduler, config.cache, kv_cache_config, model_info)
    summary = describe_capacity(
        kv_cache_config, limits.max_model_len, limits.num_blocks_per_request
    )
    return EnginePlan(kv_cache_config, limits, list(num_blocks_per_rank), summary)


def ranks_kv_transport(config: EngineConfig) -> str | None:
    """The --kv-transport the ranks get: None for role both (no NIXL agent is made); "builtin"
    for a prefill engine whose auto would hand NIXL descriptors to unauthenticated peers
    (describe_unauthenticated_nixl; an explicit nixl there is refused by check_kv_role)."""
    if config.kv_role == "both":
        return None
    address = config.kv_transfer_address
    if config.kv_role == "prefill" and config.kv_transport == "auto" and address is not None:
        reason = describe_unauthenticated_nixl(address, config.curve is not None)
        if reason is not None:
            logger.info("P/D pages move the built-in way, not through NIXL: %s", reason)
            return "builtin"
    return config.kv_transport


def check_kv_role(config: EngineConfig, kv_cache_config: KVCacheConfig) -> None:
    """FlagValueError when this engine cannot take its part in P/D (DESIGN.md §12)."""
    if config.kv_role == "both":
        return
    reason = describe_unsupported_layout(kv_cache_config)
    if reason is not None:
        raise FlagValueError(f"--kv-role {config.kv_role}: {reason}")
    if config.kv_role == "prefill" and config.kv_transfer_address is None:
        raise FlagValueError("--kv-role prefill needs --kv-transfer-address (deploy/ fills it in)")
    if config.kv_transport == "nixl" and not nixl_available():
        raise FlagValueError(
            "--kv-transport nixl: NIXL is not installed (pip install 'kvserve[nixl]'); "
            "auto or builtin serve without it"
        )
    address = config.kv_transfer_address
    if config.kv_transport == "nixl" and config.kv_role == "prefill" and address is not None:
        reason = describe_unauthenticated_nixl(address, config.curve is not None)
        if reason is not None:
            raise FlagValueError(f"--kv-transport nixl with {reason}: give --curve-keys-dir")
    if config.kv_role == "decode" and not config.cache.enable_prefix_caching:
        raise FlagValueError(
            "--kv-role decode needs prefix caching (pulled blocks join the prefix cache): "
            "drop --no-enable-prefix-caching"
        )


def plan_tier_slots(
    cache: CacheConfig, kv_cache_groups: list[KVCacheGroupSpec], tp_size: int
) -> tuple[int, int]:
    """Slots of the host and disk tiers on each rank (DESIGN.md §3.5), 0 for a tier that is off.

    The budgets cover every rank together, as vLLM's --kv-offloading-size does: each rank gets
    budget // tp_size bytes, in slots of one block's pages on that rank. FlagValueError names
    the flag whose value cannot work with this model.
    """
    host_bytes, disk_bytes = cache.kv_offload_host_bytes, cache.kv_offload_disk_bytes
    if not host_bytes and not disk_bytes:
        return 0, 0
    if disk_bytes and not host_bytes:
        raise FlagValueError(
            f"--kv-offload-disk-bytes {disk_bytes} needs a host tier above the disk tier: "
            "expected --kv-offload-host-bytes above 0"
        )
    if disk_bytes and not cache.kv_offload_disk_dir:
        raise FlagValueError(
            f"--kv-offload-disk-bytes {disk_bytes} needs --kv-offload-disk-dir: got none"
        )
    if not cache.enable_prefix_caching:
        raise FlagValueError(
            "--kv-offload-host-bytes keeps evicted prefix-cache blocks: expected prefix "
            "caching on, got it off"
        )
    reason = describe_unsupported_tiers(kv_cache_groups)
    if reason is not None:
        raise FlagValueError(reason)
    page_bytes = bytes_per_block(kv_cache_groups, tp_size)
    num_slots = []
    for flag, budget in (
        ("--kv-offload-host-bytes", host_bytes),
        ("--kv-offload-disk-bytes", disk_bytes),
    ):
        if not budget:
            num_slots.append(0)
            continue
        rank_bytes = budget // tp_size
        if rank_bytes < page_bytes:
            raise FlagValueError(
                f"{flag} {budget} gives each of the {tp_size} ranks {rank_bytes} bytes, less "
                f"than one block of {page_bytes} bytes: expected at least {page_bytes * tp_size}"
            )
        num_slots.append(rank_bytes // page_bytes)
        logger.info(
            "%s: %d slots of %d bytes on each of %d ranks (%d bytes per rank)",
            flag,
            num_slots[-1],
            page_bytes,
            tp_size,
            num_slots[-1] * page_bytes,
        )
    return num_slots[0], num_slots[1]


def check_pool_host_memory(num_blocks: int, max_pool_host_memory_bytes: int | None) -> None:
    """State the pool's host memory, and refuse a pool past the limit (None: no limit)."""
    pool_bytes = num_blocks * POOL_HOST_BYTES_PER_BLOCK
    logger.info(
        "the block pool of %d blocks takes about %.1f MiB of host memory",
        num_blocks,
        pool_bytes / 2**20,
    )
    if max_pool_host_memory_bytes is not None and pool_bytes > max_pool_host_memory_bytes:
        raise ValueError(
            f"a pool of {num_blocks} blocks needs about {pool_bytes} bytes of host memory "
            f"({POOL_HOST_BYTES_PER_BLOCK} per block), more than max_pool_host_memory_bytes="
            f"{max_pool_host_memory_bytes}: cap the pool with --num-gpu-blocks-override (at most "
            f"{max_pool_host_memory_bytes // POOL_HOST_BYTES_PER_BLOCK} blocks) or raise "
            "--max-pool-host-memory-bytes"
        )
