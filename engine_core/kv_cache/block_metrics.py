"""The BlockPool's metrics hook, and a collector that times a sample of blocks until eviction.

The pool calls the hook only when one is given, so a pool without one pays nothing. Timestamps
live here, keyed by block id, never in KVCacheBlock. No I/O: the engine drains `take_stats()`.
"""

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from engine_core.kv_cache.block import KVCacheBlock
from protocol.stats import BlockResidencyStats

DEFAULT_SAMPLE_EVERY = 100  # track one allocation in this many
DEFAULT_MAX_PENDING = 10_000  # observations of each kind kept until drained; older ones drop


class BlockMetricsHook(Protocol):
    """What BlockPool calls, when given one.

    `on_block_allocated`: `get_new_blocks` handed the block out (after evicting its old hash).
    `on_block_accessed`: `touch` took a reference on the block for a prefix-cache hit.
    `on_block_evicted`: the block's hash left the prefix cache (reuse, `evict_blocks`, reset).
    """

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...

    def on_block_accessed(self, block: KVCacheBlock) -> None: ...

    def on_block_evicted(self, block: KVCacheBlock) -> None: ...


class BlockMetricsCollector:
    """Samples one allocation in `sample_every` and times the sampled block until eviction.

    Lifetime is allocation to eviction; idle time is the last access (allocation or hit) to
    eviction; a reuse gap is the time from one access to the next hit, observed at the hit. A
    tracked block handed out again without an eviction (it was never cached) is dropped
    unfinished; that allocation, if sampled, starts a new record. Observations wait in bounded
    queues until `take_stats()` drains them, so an engine that never drains stays bounded.

    Invariants: each tracked record has `allocated_s <= last_access_s`; no queue holds more than
    `max_pending` observations.
    """

    __slots__ = (
        "_clock",
        "_idle_s",
        "_lifetimes_s",
        "_max_pending",
        "_num_allocations",
        "_reuse_gaps_s",
        "_sample_every",
        "_tracked",
    )

    def __init__(
        self,
        sample_every: int = DEFAULT_SAMPLE_EVERY,
        max_pending: int = DEFAULT_MAX_PENDING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be at least 1, got {sample_every}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._sample_every = sample_every
        self._max_pending = max_pending
        self._clock = clock
        self._num_allocations = 0
        self._tracked: dict[int, list[float]] = {}  # block_id -> [allocated_s, last_access_s]
        self._lifetimes_s: deque[float] = deque(maxlen=max_pending)
        self._idle_s: deque[float] = deque(maxlen=max_pending)
        self._reuse_gaps_s: deque[float] = deque(maxlen=max_pending)

    @classmethod
    def from_sample_rate(cls, sample_rate: float) -> "BlockMetricsCollector":
        """A collector tracking a `sample_rate` share of allocations (one in round(1 / rate))."""
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        return cls(sample_every=max(1, round(1.0 / sample_rate)))

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self._num_allocations += 1
        if self._num_allocations % self._sample_every:
            self._tracked.pop(block.block_id, None)
        else:
            now = self._clock()
            self._tracked[block.block_id] = [now, now]

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        record = self._tracked.get(block.block_id)
        if record is not None:
            now = self._clock()
            self._reuse_gaps_s.append(now - record[1])
            record[1] = now

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        record = self._tracked.pop(block.block_id, None)
        if record is not None:
            now = self._clock()
            self._lifetimes_s.append(now - record[0])
            self._idle_s.append(now - record[1])

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._tracked)

    def take_stats(self) -> BlockResidencyStats:
        """The observations since the last call, oldest first; the queues start over."""
        stats = BlockResidencyStats(
            lifetimes_s=list(self._lifetimes_s),
            idle_before_evict_s=list(self._idle_s),
            reuse_gaps_s=list(self._reuse_gaps_s),
        )
        self._lifetimes_s.clear()
        self._idle_s.clear()
        self._reuse_gaps_s.clear()
        return stats

    def check_invariants(self) -> None:
        for block_id, (allocated_s, last_access_s) in self._tracked.items():
            assert allocated_s <= last_access_s, (
                f"block {block_id} last accessed at {last_access_s} before its allocation "
                f"at {allocated_s}"
            )
        for queue in (self._lifetimes_s, self._idle_s, self._reuse_gaps_s):
            assert len(queue) <= self._max_pending, (
                f"{len(queue)} pending observations exceed max_pending={self._max_pending}"
            )
