"""ScriptedScheduler: a small stand-in for the engine's scheduler that drives ModelRunners directly.

It emits SchedulerOutputs per the wire contract (new, cached, resumed, finished, preempted; chunked
prefill; prefix hits with same-step sharing; sliding-window blocks nulled and reused) from its own
tiny block pool, so workers are tested and benchmarked without the engine (imports no engine_core).
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.buffers import pack_int32, unpack_int32
from protocol.kv_cache_spec import KVCacheConfig, SlidingWindowSpec
from protocol.sampling import SamplingParams
from protocol.worker_messages import (
    CachedRequestData,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MiniBlockPool:
    """Ref-counted block ids 1..num_blocks-1 with a prefix cache; block 0 is the null block.

    Invariants: a block is free (ref 0, in `free` once) or used (ref > 0, not in `free`);
    `cached` and `key_of` are inverse maps.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.cached: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}

    def allocate(self, count: int) -> list[int]:
        ids = [self.free.popleft() for _ in range(count)]
        for block_id in ids:
            key = self.key_of.pop(block_id, None)
            if key is not None:
                del self.cached[key]
            self.ref[block_id] = 1
        return ids

    def touch(self, block_id: int) -> None:
        if block_id == NULL_BLOCK_ID:
            return
        if self.ref[block_id] == 0:
            self.free.remove(block_id)
        self.ref[block_id] += 1

    def release(self, tail_first_ids: list[int]) -> None:
        """Unhashed blocks go to the head (reused first), hashed ones to the tail."""
        for block_id in tail_first_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            self.ref[block_id] -= 1
            assert self.ref[block_id] >= 0, f"block {block_id} freed too often"
            if self.ref[block_id] == 0:
                if block_id in self.key_of:
                    self.free.append(block_id)
                else:
                    self.free.appendleft(block_id)

    def cache(self, block_id: int, key: tuple) -> None:
        if self.enable_caching and key not in self.cached and block_id not in self.key_of:
            self.cached[key] = block_id
            self.key_of[block_id] = key

    def check_invariants(self) -> None:
        free = set(self.free)
        assert len(free) == len(self.free), "a block is queued twice"
        for block_id in range(1, len(self.ref)):
            assert (self.ref[block_id] == 0) == (block_id in free), f"block {block_id} misplaced"
        assert all(self.key_of[b] == k for k, b in self.cached.items()), "cache maps disagree"


@dataclass(slots=True, eq=False)
class ScriptedRequest:
    req_id: int
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per group
    num_cached_blocks: list[int]  # per group: blocks already in the prefix cache
    num_computed_tokens: int = 0
    num_sent_tokens: int = 0  # tokens the workers hold
    is_new: bool = True  # never sent to the workers
    output: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Scheduled:
    req: ScriptedRequest
    num_tokens: int
    new_block_ids: list[list[int]]


class ScriptedScheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Invariants: the pool's invariants hold; running and waiting requests are disjoint.
    """

    def __init__(
        self,
        model_info: ModelInfo,
        num_blocks: int,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int | None = None,
    ) -> None:
        self.model_info = model_info
        self.groups = model_info.kv_cache_groups
        self.block_size = self.groups[0].spec.block_size
        self.windows = [
            g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None
            for g in self.groups
        ]
        self.num_blocks = num_blocks
        self.pool = MiniBlockPool(num_blocks, enable_prefix_caching)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_limit = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[ScriptedRequest] = deque()
        self.running: list[ScriptedRequest] = []
        self.outputs: dict[int, list[int]] = {}
        self.step_id = 0
        self.num_preemptions = 0
        self.num_hit_tokens = 0
        self._finished_ids: list[int] = []
        self._last: list[_Scheduled] = []
        self._preempt_next = False

    def kv_cache_config(self) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=self.num_blocks, kv_cache_groups=self.groups)

    def add_request(self, req_id: int, prompt: list[int], params: SamplingParams) -> None:
        num_groups = len(self.groups)
        self.waiting.append(
            ScriptedRequest(
                req_id, list(prompt), params, [[] for _ in range(num_groups)], [0] * num_groups
            )
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def request_preemption(self) -> None:
        """Preempt the last running request at the next step, as if blocks had run out."""
        self._preempt_next = True

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        budget = self.max_num_batched_tokens
        preempted: list[int] = []
        if self._preempt_next and self.running:
            self._preempt_next = False
            preempted.append(self._preempt(self.running.pop()))
        scheduled_running: list[_Scheduled] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            count = min(len(req.token_ids) - req.num_computed_tokens, budget, self.chunk_limit)
            self._remove_skipped_blocks(req)
            new_ids = self._allocate(req, count)
            while new_ids is None:
                victim = self.running.pop()
                preempted.append(self._preempt(victim))
                if victim is req:
                    break
                new_ids = self._allocate(req, count)
            if new_ids is None:
                break
            scheduled_running.append(_Scheduled(req, count, new_ids))
            budget -= count
            idx += 1
        admitted = [] if preempted else self._admit(budget)
        return self._build_output(scheduled_running, admitted, preempted)

    def _admit(self, budget: int) -> list[_Scheduled]:
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_ids, hit = self._find_hits(req)
            for ids in hit_ids:
                for block_id in ids:
                    self.pool.touch(block_id)
            req.block_ids = [list(ids) for ids in hit_ids]
            req.num_cached_blocks = [len(ids) for ids in hit_ids]
            req.num_computed_tokens = hit
            count = min(len(req.token_ids) - hit, budget, self.chunk_limit)
            new_ids = self._allocate(req, count)
            if new_ids is None:
                self._free(req)
                if not self.running:
                    raise RuntimeError(
                        f"request {req.req_id} needs more than {self.num_blocks} blocks on its own"
                    )
                break
            self.num_hit_tokens += hit
            self.waiting.popleft()
            self.running.append(req)
            admitted.append(_Scheduled(req, count, new_ids))
            budget -= count
        return admitted

    def _find_hits(self, req: ScriptedRequest) -> tuple[list[list[int]], int]:
        """Longest block-aligned prefix every group can serve, capped below the last token."""
        num_groups, size = len(self.groups), self.block_size
        if not self.pool.enable_caching:
            return [[] for _ in range(num_groups)], 0
        num_blocks = (len(req.token_ids) - 1) // size
        while num_blocks > 0:
            hit = num_blocks * size
            per_group = [self._group_hits(req, g, num_blocks) for g in range(num_groups)]
            if all(ids is not None for ids in per_group):
                return per_group, hit
            num_blocks -= 1
        return [[] for _ in range(num_groups)], 0

    def _group_hits(self, req: ScriptedRequest, group: int, num_blocks: int) -> list[int] | None:
        window, size = self.windows[group], self.block_size
        first_needed = 0 if window is None else max(0, num_blocks * size - window + 1) // size
        ids = [NULL_BLOCK_ID] * first_needed
        for i in range(first_needed, num_blocks):
            block_id = self.pool.cached.get((group, tuple(req.token_ids[: (i + 1) * size])))
            if block_id is None:
                return None
            ids.append(block_id)
        return ids

    def _remove_skipped_blocks(self, req: ScriptedRequest) -> None:
        """Sliding groups: null the blocks wholly before the window and free them for reuse."""
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            first_useful = max(0, req.num_computed_tokens - window + 1) // self.block_size
            ids = req.block_ids[group]
            skipped = [b for b in ids[:first_useful] if b != NULL_BLOCK_ID]
            ids[:first_useful] = [NULL_BLOCK_ID] * min(first_useful, len(ids))
            self.pool.release(skipped[::-1])

    def _allocate(self, req: ScriptedRequest, count: int) -> list[list[int]] | None:
        end = req.num_computed_tokens + count
        needed = [max(0, cdiv(end, self.block_size) - len(ids)) for ids in req.block_ids]
        if sum(needed) > len(self.pool.free):
            return None
        new_ids = [self.pool.allocate(n) for n in needed]
        for group, ids in enumerate(new_ids):
            req.block_ids[group].extend(ids)
            full = end // self.block_size
            for i in range(req.num_cached_blocks[group], full):
                block_id = req.block_ids[group][i]
                if block_id != NULL_BLOCK_ID:
                    self.pool.cache(
                        block_id, (group, tuple(req.token_ids[: (i + 1) * self.block_size]))
                    )
            req.num_cached_blocks[group] = max(req.num_cached_blocks[group], full)
        return new_ids

    def _free(self, req: ScriptedRequest) -> None:
        for ids in req.block_ids:
            self.pool.release(ids[::-1])
        req.block_ids = [[] for _ in self.groups]
        req.num_cached_blocks = [0] * len(self.groups)

    def _preempt(self, req: ScriptedRequest) -> int:
        self._free(req)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        return req.req_id

    def _build_output(
        self, running: list[_Scheduled], admitted: list[_Scheduled], preempted: list[int]
    ) -> SchedulerOutput:
        new_reqs = [s for s in admitted if s.req.is_new]
        cached = running + [s for s in admitted if not s.req.is_new]
        resumed = [s.req.req_id for s in admitted if not s.req.is_new]
        new_data = [
            NewRequestData(
                s.req.req_id,
                pack_int32(s.req.token_ids),
                s.req.sampling_params,
                tuple(list(ids) for ids in s.req.block_ids),
                s.req.num_computed_tokens,
            )
            for s in new_reqs
        ]
        new_tokens = [s.req.token_ids[s.req.num_sent_tokens :] for s in cached]
        block_ids = [
            tuple(list(ids) for ids in s.req.block_ids)
            if s.req.req_id in resumed
            else (tuple(s.new_block_ids) if any(s.new_block_ids) else None)
            for s in cached
        ]
        cached_data = CachedRequestData(
            req_ids=pack_int32(s.req.req_id for s in cached),
            resumed_req_ids=resumed,
            new_token_ids=pack_int32(t for tokens in new_tokens for t in tokens),
            num_new_token_ids=pack_int32(len(tokens) for tokens in new_tokens),
            new_block_ids=block_ids,
            num_computed_tokens=pack_int32(s.req.num_computed_tokens for s in cached),
        )
        order = new_reqs + cached
        for s in order:
            s.req.num_computed_tokens += s.num_tokens
            s.req.num_sent_tokens = len(s.req.token_ids)
            s.req.is_new = False
        self._last = order
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=pack_int32(s.num_tokens for s in order),
            total_num_scheduled_tokens=sum(s.num_tokens for s in order),
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )

    def update_from_output(self, output: ModelRunnerOutput) -> None:
        """Append each completed request's token and apply the stop rules."""
        req_ids = list(unpack_int32(output.req_ids))
        if req_ids != [s.req.req_id for s in self._last]:
            raise ValueError(f"output for {req_ids} does not match the last step's requests")
        for s, token_id in zip(self._last, unpack_int32(output.sampled_token_ids), strict=True):
            req = s.req
            if req.num_computed_tokens < len(req.token_ids):
                continue  # a partial prefill chunk: the token means nothing
            req.token_ids.append(token_id)
            req.output.append(token_id)
            if self._stops(req, token_id):
                self.running.remove(req)
                self._free(req)
                self.outputs[req.req_id] = req.output
                self._finished_ids.append(req.req_id)

    def _stops(self, req: ScriptedRequest, token_id: int) -> bool:
        params, eos = req.sampling_params, self.model_info.eos_token_id
        if (
            len(req.output) >= params.max_tokens
            or len(req.token_ids) >= self.model_info.max_model_len
        ):
            return True
        if len(req.output) < params.min_tokens:
            return False
        return (token_id == eos and not params.ignore_eos) or token_id in params.stop_token_ids

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        overlap = {r.req_id for r in self.running} & {r.req_id for r in self.waiting}
        assert not overlap, f"requests both running and waiting: {sorted(overlap)}"


def run_to_completion(
    scheduler: ScriptedScheduler,
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
    max_steps: int = 100_000,
) -> dict[int, list[int]]:
    """Step until every request finished, then send one last step so workers forget them all."""
    while scheduler.has_unfinished():
        if scheduler.step_id >= max_steps:
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        scheduler.update_from_output(execute(scheduler.schedule()))
        scheduler.check_invariants()
    scheduler.update_from_output(execute(scheduler.schedule()))
    return scheduler.outputs
