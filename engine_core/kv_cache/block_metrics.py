"""The BlockPool's metrics hook, and a collector of block lifetime and idle time before eviction.

The pool calls the hook only when one is given, so a pool without one pays nothing. Timestamps
live here, keyed by block id, never in KVCacheBlock. No I/O: exporters read `summary()`.
"""

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine_core.kv_cache.block import KVCacheBlock

DEFAULT_SAMPLE_EVERY = 100  # track one allocation in this many
DEFAULT_MAX_SAMPLES = 10_000  # evictions kept for the percentiles; older ones are dropped


class BlockMetricsHook(Protocol):
    """What BlockPool calls, when given one.

    `on_block_allocated`: `get_new_blocks` handed the block out (after evicting its old hash).
    `on_block_accessed`: `touch` took a reference on the block for a prefix-cache hit.
    `on_block_evicted`: the block's hash left the prefix cache (reuse, `evict_blocks`, reset).
    """

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...


@dataclass(frozen=True, slots=True)
class BlockResidencySummary:
    """Block residency over the kept samples, in seconds; medians and 90th percentiles."""

    num_samples: int
    lifetime_p50_s: float
    lifetime_p90_s: float
    idle_before_eviction_p50_s: float
    idle_before_eviction_p90_s: float
    accesses_per_block_mean: float


class BlockMetricsCollector:
    """Samples one allocation in `sample_every` and times the sampled block until eviction.

    Lifetime is allocation to eviction; idle time is the last access (allocation or hit) to
    eviction. A tracked block handed out again without an eviction (it was never cached) is
    dropped unfinished; that allocation, if sampled, starts a new record.

    Invariants: each tracked record has `allocated_s <= last_access_s`; at most
    `max_samples` finished samples are kept, and the three sample queues have equal length.
    """

    __slots__ = (
        "_clock",
        "_idle_s",
        "_lifetimes_s",
        "_num_accesses",
        "_num_allocations",
        "_sample_every",
        "_tracked",
    )

    def __init__(
        self,
        sample_every: int = DEFAULT_SAMPLE_EVERY,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be at least 1, got {sample_every}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be at least 1, got {max_samples}")
        self._sample_every = sample_every
        self._clock = clock
        self._num_allocations = 0
        self._tracked: dict[int, list[float]] = {}  # block_id -> [allocated_s, last_access_s, hits]
        self._lifetimes_s: deque[float] = deque(maxlen=max_samples)
        self._idle_s: deque[float] = deque(maxlen=max_samples)
        self._num_accesses: deque[float] = deque(maxlen=max_samples)

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self._num_allocations += 1
        if self._num_allocations % self._sample_every:
            self._tracked.pop(block.block_id, None)
        else:
            now = self._clock()
            self._tracked[block.block_id] = [now, now, 0.0]

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        record = self._tracked.get(block.block_id)
        if record is not None:
            record[1] = self._clock()
            record[2] += 1.0

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        record = self._tracked.pop(block.block_id, None)
        if record is not None:
            now = self._clock()
            self._lifetimes_s.append(now - record[0])
            self._idle_s.append(now - record[1])
            self._num_accesses.append(record[2])

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._tracked)

    def summary(self) -> BlockResidencySummary | None:
        """Percentiles over the kept samples, or None before the first sampled eviction."""
        if not self._lifetimes_s:
            return None
        lifetimes, idle = sorted(self._lifetimes_s), sorted(self._idle_s)
        return BlockResidencySummary(
            num_samples=len(lifetimes),
            lifetime_p50_s=statistics.median(lifetimes),
            lifetime_p90_s=percentile(lifetimes, 0.9),
            idle_before_eviction_p50_s=statistics.median(idle),
            idle_before_eviction_p90_s=percentile(idle, 0.9),
            accesses_per_block_mean=statistics.fmean(self._num_accesses),
        )

    def check_invariants(self) -> None:
        for block_id, (allocated_s, last_access_s, _) in self._tracked.items():
            assert allocated_s <= last_access_s, (
                f"block {block_id} last accessed at {last_access_s} before its allocation "
                f"at {allocated_s}"
            )
        lengths = (len(self._lifetimes_s), len(self._idle_s), len(self._num_accesses))
        assert len(set(lengths)) == 1, f"sample queues have unequal lengths {lengths}"


def percentile(sorted_values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of an ascending, non-empty list."""
    rank = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[rank]
