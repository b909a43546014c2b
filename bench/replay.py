"""The timed replay loops of the trace benchmarks, run alike by kvserve and by its vLLM peer.

Standard library only, like bench/trace.py, so a peer imports it without kvserve: each side hands
in its own pool or manager and requests, and both sides time the very same loop.
"""

import gc
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.trace import Trace, prompt_hit_rate, replay_plan, replay_through_pool

LARGE_POOL_BLOCKS = 1_000_000


def _timed_s(fn: Callable[[], object]) -> float:
    """Seconds of one call, after a collection so garbage left by earlier runs is not timed."""
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class PoolReplayBench:
    """One trace through a BlockPool (vLLM v1 API): a counted replay, then timed samples.

    Invariants: `total_s` and `pool_only_s` hold one sample per `sample` round each;
    `checked_pool` is the pool the counted replay ran through, for the caller to inspect.
    """

    def __init__(
        self,
        trace: Trace,
        token_ids: list[Sequence[int]],
        hash_prefix: Callable[[Sequence[int]], list[bytes]],
        new_pool: Callable[[int], Any],
    ) -> None:
        self.trace, self.token_ids = trace, token_ids
        self.hash_prefix, self.new_pool = hash_prefix, new_pool
        self.plan = replay_plan(trace)
        self.hashes = [hash_prefix(tokens) for tokens in token_ids]
        self.checked_pool = new_pool(trace.config.num_gpu_blocks)
        self.result = replay_through_pool(
            self.checked_pool, trace, self.plan, token_ids, None, self.hashes, True
        )
        self.total_s: list[float] = []  # one sample per run, hashing included
        self.pool_only_s: list[float] = []  # one sample per run, hashes precomputed

    def check_invariants(self) -> None:
        assert len(self.total_s) == len(self.pool_only_s), "unpaired timing samples"

    def sample(self, repeats: int) -> None:
        """Time `repeats` replays each way, alternating, so load drift hits both alike."""
        for _ in range(repeats):
            self.total_s.append(self._time_replay(with_hashing=True))
            self.pool_only_s.append(self._time_replay(with_hashing=False))

    def _time_replay(self, with_hashing: bool) -> float:
        pool = self.new_pool(self.trace.config.num_gpu_blocks)
        hash_prefix, hashes = (self.hash_prefix, None) if with_hashing else (None, self.hashes)
        args = (pool, self.trace, self.plan, self.token_ids, hash_prefix, hashes)
        return _timed_s(lambda: replay_through_pool(*args))

    def figures(self) -> dict[str, float | int]:
        num_requests = len(self.trace.requests)
        total_s = statistics.median(self.total_s)
        return {
            "us_per_request": total_s / num_requests * 1e6,
            "requests_per_s": num_requests / total_s,
            "pool_only_us_per_request": statistics.median(self.pool_only_s) / num_requests * 1e6,
            "prefix_hit_rate": prompt_hit_rate(self.trace, self.result),
            "num_hit_blocks": self.result.num_hit_blocks,
            "num_evicted_blocks": self.result.num_evicted_blocks,
        }


def measure_large_pool(repeats: int, new_pool: Callable[[int], Any]) -> dict[str, float]:
    """Construction time (median) and traced memory of a pool of 1,000,000 blocks."""
    construct_s = statistics.median(
        _timed_s(lambda: new_pool(LARGE_POOL_BLOCKS)) for _ in range(repeats)
    )
    gc.collect()
    tracemalloc.start()
    pool = new_pool(LARGE_POOL_BLOCKS)
    size_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool
    return {
        "construct_1m_blocks_ms": construct_s * 1e3,
        "memory_1m_blocks_bytes_per_block": size_bytes / LARGE_POOL_BLOCKS,
    }


@dataclass(slots=True)
class ManagerReplayResult:
    """What one replay did; both sides must agree on every count for the same trace."""

    manager_s: float  # time inside get_computed_blocks, allocate_slots and free
    replay_s: float  # the whole loop, token appends and bookkeeping included
    num_hit_tokens: int
    num_preemptions: int
    num_allocations: int
    num_failed_allocations: int


@dataclass(frozen=True, slots=True)
class PrefillChunks:
    """How a layout whose prefills must run in chunks (an align-mode Mamba group) splits them.

    Each side hands in its own scheduler's rule, `clip(request, num_computed_tokens,
    num_new_tokens) -> tokens to schedule` (hits count as computed), and the per-step hook its
    manager needs, if any; the replay caps every chunk at `max_chunk_tokens` before clipping.
    """

    clip: Callable[[Any, int, int], int]
    max_chunk_tokens: int
    new_step_starts: Callable[[], None] | None = None


class ManagerReplay:
    """The replay rule of the KVCacheManager benchmark, for kvserve's manager and vLLM's alike.

    Each step admits the head of the waiting queue when fewer than `max_running` run, then gives
    every running request one token: a finished one is freed, and a decode that does not fit
    preempts the youngest running request (possibly itself) to the front of the queue.
    With `chunks`, steps are planned as a scheduler plans them (see `step_in_chunks`).
    Invariants: every request index is in exactly one of `waiting`, `running`, or neither (done).
    """

    def __init__(
        self,
        manager: Any,
        requests: list,
        outputs: list[list[int]],
        preempted_status: object,
        chunks: PrefillChunks | None = None,
    ) -> None:
        self.manager, self.requests, self.outputs = manager, requests, outputs
        self.chunks = chunks
        self.planned: dict[int, int] = {}  # with chunks: request index -> tokens this step
        self.preempted_status = preempted_status  # each side's RequestStatus.PREEMPTED
        self.waiting, self.running = deque(range(len(requests))), []
        self.manager_s = 0.0
        self.num_hit_tokens = self.num_preemptions = self.num_allocations = self.num_failed = 0

    def run(self, max_running: int) -> ManagerReplayResult:
        start = time.perf_counter()
        while self.chunks is not None and (self.waiting or self.running):
            self.step_in_chunks(max_running)
        while self.waiting or self.running:
            if self.waiting and len(self.running) < max_running:
                self.admit_head()
            for idx in list(self.running):
                if idx in self.running:  # not preempted earlier in this step
                    self.decode(idx)
        replay_s = time.perf_counter() - start
        return ManagerReplayResult(
            self.manager_s,
            replay_s,
            self.num_hit_tokens,
            self.num_preemptions,
            self.num_allocations,
            self.num_failed,
        )

    def admit_head(self) -> None:
        request = self.requests[self.waiting[0]]
        start = time.perf_counter()
        computed = self.manager.get_computed_blocks(request)  # vLLM's answer has a third item
        self.manager_s += time.perf_counter() - start
        hits, num_hits = computed[0], computed[1]
        if self.admit(request, request.num_tokens - num_hits, num_hits, hits):
            request.num_computed_tokens = request.num_tokens

    def admit(self, request: Any, num_new_tokens: int, num_hits: int, hits: Any) -> bool:
        """Allocate the head's slots past its hit (timed); on success it leaves the queue."""
        start = time.perf_counter()
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, num_hits, hits)
        self.manager_s += time.perf_counter() - start
        self.num_allocations += 1
        if new_blocks is None:
            self.num_failed += 1
            return False
        self.running.append(self.waiting.popleft())
        self.num_hit_tokens += num_hits
        return True

    def decode(self, idx: int) -> None:
        request, output = self.requests[idx], self.outputs[idx]
        if request.num_output_tokens == len(output):
            self.free(request)
            self.running.remove(idx)
            return
        request.append_output_token_ids(output[request.num_output_tokens])
        while True:
            start = time.perf_counter()
            new_blocks = self.manager.allocate_slots(request, 1)
            self.manager_s += time.perf_counter() - start
            self.num_allocations += 1
            if new_blocks is not None:
                request.num_computed_tokens += 1
                return
            self.num_failed += 1
            if self.preempt_youngest() == idx:
                return

    def preempt_youngest(self) -> int:
        victim_idx = self.running.pop()
        victim = self.requests[victim_idx]
        self.free(victim)
        victim.status = self.preempted_status
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim_idx)
        return victim_idx

    def free(self, request: Any) -> None:
        start = time.perf_counter()
        self.manager.free(request)
        self.manager_s += time.perf_counter() - start

    def step_in_chunks(self, max_running: int) -> None:
        """One step planned as the schedulers plan it: the manager's step hook, then each running
        request's next prefill chunk or decode token (oldest first, a chunk that does not fit
        preempting the youngest), then the head of the queue unless the step preempted.

        Computed tokens advance once the whole step is planned, as both schedulers advance them,
        so a state a step publishes is not yet there for a hit within that step. A preempted
        request is the youngest running one, never one planned earlier in the step.
        """
        assert self.chunks is not None
        if self.chunks.new_step_starts is not None:
            start = time.perf_counter()
            self.chunks.new_step_starts()
            self.manager_s += time.perf_counter() - start
        num_preemptions = self.num_preemptions
        for idx in list(self.running):
            if idx in self.running:  # not preempted earlier in this step
                self.advance(idx)
        has_room = self.waiting and len(self.running) < max_running
        if has_room and self.num_preemptions == num_preemptions:
            self.admit_head_chunk()
        for idx, num_new_tokens in self.planned.items():
            self.requests[idx].num_computed_tokens += num_new_tokens
        self.planned.clear()

    def admit_head_chunk(self) -> None:
        """The head's prefix hit and its first prefill chunk, as the side's rule clips it."""
        assert self.chunks is not None
        idx = self.waiting[0]
        request = self.requests[idx]
        start = time.perf_counter()
        computed = self.manager.get_computed_blocks(request)
        self.manager_s += time.perf_counter() - start
        hits, num_hits = computed[0], computed[1]
        num_new_tokens = min(request.num_tokens - num_hits, self.chunks.max_chunk_tokens)
        num_new_tokens = self.chunks.clip(request, num_hits, num_new_tokens)
        if not num_new_tokens:  # never with a chunk cap of at least a block
            return
        if self.admit(request, num_new_tokens, num_hits, hits):
            self.planned[idx] = num_hits + num_new_tokens

    def advance(self, idx: int) -> None:
        """A running request's next prefill chunk, or its next token (or its end) once prefilled."""
        assert self.chunks is not None
        request = self.requests[idx]
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        if num_new_tokens > 0:
            num_new_tokens = min(num_new_tokens, self.chunks.max_chunk_tokens)
            num_new_tokens = self.chunks.clip(request, request.num_computed_tokens, num_new_tokens)
            if not num_new_tokens:
                return
        else:
            output = self.outputs[idx]
            if request.num_output_tokens == len(output):
                self.free(request)
                self.running.remove(idx)
                return
            request.append_output_token_ids(output[request.num_output_tokens])
            num_new_tokens = 1
        while True:
            start = time.perf_counter()
            new_blocks = self.manager.allocate_slots(request, num_new_tokens)
            self.manager_s += time.perf_counter() - start
            self.num_allocations += 1
            if new_blocks is not None:
                self.planned[idx] = num_new_tokens
                return
            self.num_failed += 1
            if self.preempt_youngest() == idx:
                return
