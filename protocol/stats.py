"""Engine statistics as typed Structs, from the KV-cache manager to /metrics, logs and `get_stats`.

Every counter is a total since the engine started, kept by the one object that counts it; readers
take differences. `stat_values` flattens a snapshot into the dict that `get_stats` sends.
"""

import msgspec

from protocol.client_messages import StatValue


class PrefixCacheStats(msgspec.Struct):
    """Prefix-cache lookups, counted once per admission since the engine started.

    Queries and hits count prompt tokens. Re-admissions after preemption are counted apart: their
    hits are mostly their own blocks recomputed, not prefixes shared between requests. The
    KV-cache manager owns the one live instance and hands out copies.
    """

    requests: int = 0  # admissions of requests never preempted
    queries: int = 0  # their prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache
    preempted_requests: int = 0  # re-admissions of preempted requests
    preempted_queries: int = 0  # their tokens looked up
    preempted_hits: int = 0  # of those, tokens found in the cache
    resets: int = 0  # times the prefix cache was cleared
    # The tiers below the pool (DESIGN.md §3.5), over every admission, preempted ones included:
    # Each tier hit counts once, in the tier it came from (`hits` counts every tier's):
    host_hits: int = 0  # tokens of the hits above found in the host tier
    disk_hits: int = 0  # tokens of the hits above found on disk (fetched up through the host)
    blocks_to_host: int = 0  # blocks copied device -> host (the pool evicted them)
    blocks_to_disk: int = 0  # blocks copied host -> disk (the host tier evicted them)
    blocks_from_disk: int = 0  # blocks copied disk -> host (a disk hit promoted)
    blocks_from_host: int = 0  # blocks copied host -> device (a host hit)
    disk_read_failures: int = 0  # disk slots whose checksum failed on a read: misses
    disk_write_failures: int = 0  # disk slots a rank could not write: dropped


class SchedulerStats(msgspec.Struct, frozen=True):
    """A snapshot of the scheduler: current counts, and totals since the engine started."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # share of usable blocks held by requests, 0.0 to 1.0
    num_preemptions: int  # total
    num_steps: int  # steps scheduled, total
    prefix_cache: PrefixCacheStats


class EngineStats(msgspec.Struct, frozen=True):
    """What `get_stats` answers: the scheduler's snapshot and the step loop's own figures."""

    scheduler: SchedulerStats
    tp_size: int
    num_engine_steps: int  # steps the loop ran, total
    num_output_tokens: int  # tokens sent to clients, total
    peak_kv_cache_usage: float  # the highest usage seen after any step, 0.0 to 1.0
    client_backlog_bytes: int  # encoded outputs waiting for slow clients now
    # Where the engine's time per step goes, in seconds, totals since the engine started:
    step_schedule_s: float = 0.0  # Scheduler.schedule
    step_encode_s: float = 0.0  # encoding each SchedulerOutput once
    step_transport_s: float = 0.0  # sending each step, then waiting for every rank's reply
    step_update_s: float = 0.0  # Scheduler.update_from_output
    num_worker_restarts: int = 0  # worker generations replaced after a rank fault
    # Seconds inside the model's forward, total, per step the least busy rank's: against wall
    # time it is the share of the ranks' time the model itself takes
    rank_forward_s: float = 0.0


class BlockResidencyStats(msgspec.Struct, frozen=True):
    """Timings of sampled KV-cache blocks since the last drain, in seconds, oldest first."""

    lifetimes_s: list[float] = []  # allocation to eviction of the block's hash
    idle_before_evict_s: list[float] = []  # last allocation or hit to eviction
    reuse_gaps_s: list[float] = []  # between two accesses (allocation or hit) of one block


def stat_values(stats: SchedulerStats | EngineStats) -> dict[str, StatValue]:
    """One flat dict, as `get_stats` sends it: the scheduler's fields keep their names, and the
    prefix-cache fields take a `prefix_cache_` prefix (`prefix_cache_hits`)."""
    scheduler = stats.scheduler if isinstance(stats, EngineStats) else stats
    values: dict[str, StatValue] = msgspec.structs.asdict(scheduler)
    del values["prefix_cache"]
    for name, value in msgspec.structs.asdict(scheduler.prefix_cache).items():
        values[f"prefix_cache_{name}"] = value
    if isinstance(stats, EngineStats):
        values.update(msgspec.structs.asdict(stats))
        del values["scheduler"]
    return values
