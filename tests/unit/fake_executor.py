"""FakeExecutor: an in-process stand-in for the workers that also checks every SchedulerOutput.

Token rule: the next token of a sequence is crc32 of its int32 bytes (prompt and all generated
tokens) modulo the vocabulary, so a run with preemption yields the same tokens as one without.
With `TierMemory` it also keeps the pages of every KV-cache group (each position holds the
crc32 of the prefix up to it), runs each step's tier copies on them, and samples from what the
pages hold: a page copied wrong, or read before it was written, changes the tokens.
Logprob rule (fake_logprobs): a request that asks for N gets, per sampled token, the token then N
ids after it, logprobs that name the token's position, and rank 1 + position % 3, so an entry
delivered with the wrong token is seen.
"""

import zlib
from array import array
from collections.abc import Callable

from engine_core.core import EngineCore
from engine_core.sched.admission import scoped_req_id
from engine_core.sched.request import Request
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    TokenLogprobs,
)
from protocol.config import CacheConfig, EngineConfig, SchedulerConfig
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from protocol.sampling import SamplingParams
from protocol.worker_messages import KVTransfers, ModelInfo, ModelRunnerOutput, SchedulerOutput


def next_token(token_ids: array, vocab_size: int) -> int:
    """The fake model: a pure function of the whole sequence."""
    return zlib.crc32(pack_int32(token_ids)) % vocab_size


def reference_tokens(prompt: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """What the fake model generates from `prompt` alone, for `num_tokens` steps."""
    tokens = array("i", prompt)
    out = []
    for _ in range(num_tokens):
        token = next_token(tokens, vocab_size)
        tokens.append(token)
        out.append(token)
    return out


def fake_logprobs(
    token_id: int, position: int, num_logprobs: int, vocab_size: int
) -> TokenLogprobs:
    """What the fake workers send for the token sampled at `position` of a sequence."""
    ids = [token_id] + [(token_id + 1 + idx) % vocab_size for idx in range(num_logprobs)]
    values = [-position / 8.0] + [-(position + idx + 1) / 8.0 for idx in range(num_logprobs)]
    return TokenLogprobs([ids], [values], [1 + position % 3])


def _pairs(data: bytes) -> list[tuple[int, int]]:
    values = unpack_int32(data)
    return list(zip(values[::2], values[1::2], strict=True))


class TierMemory:
    """The ranks' paged cache and their host and disk tier slots, as the ranks run a step's
    copies (in KVTransfers' field order, before the forward).

    A page is a list of per-position fingerprints (None: never written), in every KV-cache
    group. A disk slot in `corrupt_disk_slots` fails its next read's checksum, and one in
    `failing_disk_writes` its next write: both are reported in the reply's failed_disk_slots,
    and a failed read leaves its host slot empty, as a rank would.
    """

    def __init__(
        self,
        block_size: int,
        num_host_slots: int,
        num_disk_slots: int,
        windows: list[int | None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.windows = windows or [None]  # per KV-cache group: its sliding window, or None
        self.num_host_slots = num_host_slots
        self.num_disk_slots = num_disk_slots
        self.pages: dict[int, list[int | None]] = {}  # block id -> its page
        self.host: dict[int, list[int | None] | None] = {}
        self.disk: dict[int, list[int | None] | None] = {}
        self.corrupt_disk_slots: set[int] = set()
        self.failing_disk_writes: set[int] = set()
        self.num_copies = {"host_to_disk": 0, "device_to_host": 0, "disk_to_host": 0}
        self.num_copies["host_to_device"] = 0

    def run(self, transfers: KVTransfers) -> list[int]:
        """Run one step's copies; the disk slots that failed."""
        failed: list[int] = []
        for host_slot, disk_slot in _pairs(transfers.host_to_disk):
            assert 0 <= disk_slot < self.num_disk_slots, f"disk slot {disk_slot} out of range"
            page = self._read(self.host, host_slot, self.num_host_slots, "host")
            self.corrupt_disk_slots.discard(disk_slot)
            if disk_slot in self.failing_disk_writes:
                self.failing_disk_writes.discard(disk_slot)
                self.disk[disk_slot] = None
                failed.append(disk_slot)
            else:
                self.disk[disk_slot] = list(page)
        for block_id, host_slot in _pairs(transfers.device_to_host):
            assert 0 <= host_slot < self.num_host_slots, f"host slot {host_slot} out of range"
            page = self.pages.get(block_id)
            assert page is not None and None not in page, f"block {block_id} copied out unfull"
            self.host[host_slot] = list(page)
        for disk_slot, host_slot in _pairs(transfers.disk_to_host):
            assert 0 <= host_slot < self.num_host_slots, f"host slot {host_slot} out of range"
            if disk_slot in self.corrupt_disk_slots or self.disk.get(disk_slot) is None:
                self.host[host_slot] = None
                failed.append(disk_slot)
            else:
                self.host[host_slot] = list(self._read(self.disk, disk_slot, 0, "disk"))
        for host_slot, block_id in _pairs(transfers.host_to_device):
            page = self._read(self.host, host_slot, self.num_host_slots, "host")
            self.pages[block_id] = list(page)
        for name in self.num_copies:
            self.num_copies[name] += len(getattr(transfers, name)) // 8
        return failed

    @staticmethod
    def _read(
        memory: dict[int, list[int | None] | None], slot: int, num_slots: int, tier: str
    ) -> list[int | None]:
        assert not num_slots or 0 <= slot < num_slots, f"{tier} slot {slot} out of range"
        page = memory.get(slot)
        assert page is not None, f"{tier} slot {slot} is read before anything valid was written"
        return page

    def write(self, block_ids: list[int], tokens: array, start: int, end: int) -> None:
        """The forward writes the K/V of positions [start, end): here, their prefix's crc32."""
        size = self.block_size
        crc = zlib.crc32(pack_int32(tokens[:start]))
        for pos in range(start, end):
            crc = zlib.crc32(pack_int32(tokens[pos : pos + 1]), crc)
            page = self.pages.setdefault(block_ids[pos // size], [None] * size)
            page[pos % size] = crc

    def read_matches(
        self, block_ids: list[int], tokens: array, end: int, window: int | None = None
    ) -> bool:
        """Whether the pages hold the K/V that token `end` reads: positions [0, end), or under a
        sliding window its last `window - 1` of them."""
        size = self.block_size
        first = 0 if window is None else max(end - window + 1, 0)
        crc = zlib.crc32(pack_int32(tokens[:first]))
        for pos in range(first, end):
            crc = zlib.crc32(pack_int32(tokens[pos : pos + 1]), crc)
            page = self.pages.get(block_ids[pos // size])
            if page is None or page[pos % size] != crc:
                return False
        return True


class _WorkerRequest:
    __slots__ = ("block_ids", "num_computed_tokens", "num_logprobs", "tokens")

    def __init__(
        self,
        tokens: array,
        block_ids: list[list[int]],
        num_computed_tokens: int,
        num_logprobs: int | None = None,
    ) -> None:
        self.tokens = tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.num_logprobs = num_logprobs  # the request's sampling_params.logprobs


class FakeExecutor:
    """Keeps each request's tokens and block table the way a worker would, and samples.

    Invariants checked on every step (AssertionError otherwise): step ids are consecutive,
    finished and cached handles are known, new handles are new, the scheduled counts sum to the
    total and stay within `max_num_batched_tokens`, `num_computed_tokens` agrees with the
    worker's own view, block tables only grow except on resume, and each table covers the
    tokens scheduled for it.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        max_num_batched_tokens: int,
        tier_memory: TierMemory | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.tier_memory = tier_memory
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[int, _WorkerRequest] = {}
        self.seen_handles: set[int] = set()
        self.preempted: set[int] = set()
        self.last_step_id = 0
        self.num_steps = 0
        self.on_step: Callable[[SchedulerOutput], None] | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        assert out.step_id == self.last_step_id + 1, (out.step_id, self.last_step_id)
        self.last_step_id = out.step_id
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(out)
        failed_disk_slots: list[int] = []
        if out.kv_transfers is not None:
            assert self.tier_memory is not None, f"step {out.step_id} copies with no tiers"
            failed_disk_slots = self.tier_memory.run(out.kv_transfers)
        self._drop(out)
        handles = self._add_new(out) + self._apply_cached(out)
        num_scheduled = unpack_int32(out.num_scheduled_tokens)
        assert len(num_scheduled) == len(handles), (len(num_scheduled), len(handles))
        assert sum(num_scheduled) == out.total_num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(set(handles)) == len(handles), f"a handle is scheduled twice: {handles}"
        sampled = array("i")
        logprobs, logprob_ids, ranks = array("f"), array("i"), array("i")
        for handle, num_tokens in zip(handles, num_scheduled, strict=True):
            state = self.requests[handle]
            num_known = len(state.tokens)
            token_id = self._run(handle, num_tokens)
            sampled.append(token_id)
            if state.num_logprobs is not None and len(state.tokens) > num_known:
                entry = fake_logprobs(token_id, num_known, state.num_logprobs, self.vocab_size)
                logprobs.extend(entry.logprobs[0])
                logprob_ids.extend(entry.token_ids[0])
                ranks.extend(entry.sampled_token_ranks)
        return ModelRunnerOutput(
            out.step_id,
            0,
            pack_int32(handles),
            pack_int32(sampled),
            1,
            logprobs.tobytes(),
            pack_int32(logprob_ids),
            pack_int32(ranks),
            failed_disk_slots=pack_int32(failed_disk_slots),
        )

    def _drop(self, out: SchedulerOutput) -> None:
        for handle in out.finished_handles:
            assert handle in self.requests, f"finished handle {handle} is unknown"
            del self.requests[handle]
            self.preempted.discard(handle)
        for handle in out.preempted_handles:
            assert handle in self.requests, f"preempted handle {handle} is unknown"
            self.requests[handle].block_ids = [[] for _ in self.requests[handle].block_ids]
            self.requests[handle].num_computed_tokens = 0
            self.preempted.add(handle)

    def _add_new(self, out: SchedulerOutput) -> list[int]:
        handles = []
        for new in out.scheduled_new_reqs:
            assert new.handle not in self.seen_handles, f"handle {new.handle} is not new"
            self.seen_handles.add(new.handle)
            tokens = unpack_int32(new.prompt_token_ids)
            self.requests[new.handle] = _WorkerRequest(
                tokens,
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.sampling_params.logprobs,
            )
            handles.append(new.handle)
        return handles

    def _apply_cached(self, out: SchedulerOutput) -> list[int]:
        cached = out.scheduled_cached_reqs
        handles = list(unpack_int32(cached.handles))
        num_computed = unpack_int32(cached.num_computed_tokens)
        num_new_tokens = unpack_int32(cached.num_new_token_ids)
        new_tokens = unpack_int32(cached.new_token_ids)
        assert sum(num_new_tokens) == len(new_tokens)
        resumed = set(cached.resumed_handles)
        assert resumed <= set(handles), "a resumed handle is not scheduled"
        start = 0
        for idx, handle in enumerate(handles):
            assert handle in self.requests, f"cached handle {handle} is unknown"
            state = self.requests[handle]
            state.tokens.extend(new_tokens[start : start + num_new_tokens[idx]])
            start += num_new_tokens[idx]
            block_ids = cached.new_block_ids[idx]
            if handle in resumed:
                assert handle in self.preempted, f"handle {handle} resumed but never preempted"
                assert block_ids is not None, f"resumed handle {handle} has no block table"
                self.preempted.discard(handle)
                state.block_ids = [list(ids) for ids in block_ids]
                state.num_computed_tokens = num_computed[idx]
            else:
                assert handle not in self.preempted, f"preempted handle {handle} ran unresumed"
                for group_ids, new_ids in zip(state.block_ids, block_ids or (), strict=False):
                    group_ids.extend(new_ids)
            assert num_computed[idx] == state.num_computed_tokens, (
                f"handle {handle}: scheduler says {num_computed[idx]} computed, "
                f"worker has {state.num_computed_tokens}"
            )
        return handles

    def _run(self, handle: int, num_tokens: int) -> int:
        state = self.requests[handle]
        assert num_tokens >= 1, f"handle {handle} scheduled with {num_tokens} tokens"
        end = state.num_computed_tokens + num_tokens
        assert end <= len(state.tokens), f"handle {handle}: {end} tokens of {len(state.tokens)}"
        for group_ids in state.block_ids:
            assert len(group_ids) * self.block_size >= end, (
                f"handle {handle}: {len(group_ids)} blocks cannot hold {end} tokens"
            )
            assert 0 not in group_ids[-1:], f"handle {handle} writes into the null block"
        start = state.num_computed_tokens
        state.num_computed_tokens = end
        memory = self.tier_memory
        is_read_wrong = False
        if memory is not None:  # the forward reads what each group keeps, then writes its tokens
            for group_ids, window in zip(state.block_ids, memory.windows, strict=True):
                is_read_wrong |= not memory.read_matches(group_ids, state.tokens, start, window)
                memory.write(group_ids, state.tokens, start, end)
        if end < len(state.tokens):
            return 0  # a partial prefill chunk: the scheduler ignores this sample
        token = next_token(state.tokens, self.vocab_size)
        if is_read_wrong:  # attention read K/V of other tokens: so does the sample
            token = (token + 1) % self.vocab_size
        state.tokens.append(token)  # a worker keeps what it samples; the engine never resends it
        return token

    def check_empty(self) -> None:
        assert not self.requests, f"workers still hold handles {sorted(self.requests)}"


class Harness:
    """An EngineCore over a FakeExecutor with tiny sizes, recording each request's outputs.

    `check_no_leaks()` drains the engine and asserts that no request state remains and every
    block but the null one is free, in the scheduler, the pool and the fake workers.
    """

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        vocab_size: int = 64,
        eos_token_ids: list[int] | None = None,
        max_model_len: int = 128,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        num_host_slots: int = 0,
        num_disk_slots: int = 0,
        **scheduler_fields: object,
    ) -> None:
        groups = [KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size, 1, 8, "float32"))]
        if sliding_window is not None:  # a hybrid model: a second, sliding-window group
            spec = SlidingWindowSpec(block_size, 1, 8, "float32", sliding_window)
            groups.append(KVCacheGroupSpec(["layer.1"], spec))
        model_info = ModelInfo("fake", vocab_size, eos_token_ids or [], max_model_len, groups)
        # Step-by-step stories read the synchronous loop; a test asks for the other explicitly.
        scheduler_fields.setdefault("async_scheduling", False)
        config = EngineConfig(
            check_invariants=True,
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(**scheduler_fields),
        ).checked()
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.is_window_group = [isinstance(group.spec, SlidingWindowSpec) for group in groups]
        # With tiers, the workers' pages are modelled and the tokens sampled from them.
        self.tier_memory = None
        if num_host_slots:
            windows = [sliding_window if is_window else None for is_window in self.is_window_group]
            self.tier_memory = TierMemory(block_size, num_host_slots, num_disk_slots, windows)
        self.executor = FakeExecutor(
            vocab_size, block_size, config.scheduler.max_num_batched_tokens, self.tier_memory
        )
        kv_cache_config = KVCacheConfig(
            num_blocks, groups, num_host_slots=num_host_slots, num_disk_slots=num_disk_slots
        )
        self.start_engine(config, kv_cache_config, model_info)

    def start_engine(
        self, config: EngineConfig, kv_cache_config: KVCacheConfig, model_info: ModelInfo
    ) -> None:
        """The EngineCore over self.executor, and empty records of its outputs."""
        self.core = EngineCore(config, kv_cache_config, model_info, self.executor)
        self.scheduler = self.core.scheduler
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, FinishReason] = {}
        self.errors: dict[str, str | None] = {}
        self.num_cached_tokens: dict[str, int] = {}
        self.logprobs: dict[str, list[TokenLogprobs]] = {}  # of requests that asked, per output
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.client_ids: dict[str, bytes] = {}  # the client that submitted each request
        self.executor.on_step = self.scheduler_outputs.append

    def add(
        self,
        req_id: str,
        prompt: list[int],
        client_id: bytes = b"client",
        priority: int = 0,
        arrival_time: float = 0.0,
        **params: object,
    ) -> EngineCoreOutputs | None:
        params.setdefault("ignore_eos", True)
        request = EngineCoreRequest(
            req_id, pack_int32(prompt), SamplingParams(**params), arrival_time, priority
        )
        rejection = self.core.add_request(request, client_id)
        if rejection is None:
            self.tokens[req_id] = []
            self.client_ids[req_id] = client_id
        else:
            self._record(rejection)
        return rejection

    def request(self, req_id: str) -> Request:
        """The scheduler's state of a request this harness submitted (ids are client-scoped)."""
        return self.scheduler.requests[scoped_req_id(self.client_ids[req_id], req_id)]

    def handle(self, req_id: str) -> int:
        return self.request(req_id).handle

    def step(self) -> dict[bytes, EngineCoreOutputs]:
        outputs = self.core.step()
        for client_outputs in outputs.values():
            self._record(client_outputs)
        return outputs

    def abort(self, req_ids: list[str], client_id: bytes = b"client") -> None:
        for client_outputs in self.core.abort_requests(req_ids, client_id).values():
            self._record(client_outputs)

    def _record(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            assert output.req_id not in self.finish_reasons, f"{output.req_id} finished twice"
            self.tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            if output.new_logprobs is not None:
                self.logprobs.setdefault(output.req_id, []).append(output.new_logprobs)
            self.num_cached_tokens[output.req_id] = output.num_cached_tokens
            if output.finish_reason is not None:
                self.finish_reasons[output.req_id] = output.finish_reason
                self.errors[output.req_id] = output.error

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left and the workers were told of every finish."""
        num_steps = 0
        while self.core.has_work():
            assert num_steps < max_steps, f"not done after {max_steps} steps"
            self.step()
            num_steps += 1
        return num_steps

    def check_worker_tables(self) -> None:
        """The workers' block tables are the KV-cache manager's, for every running request,
        except where a window group has put the null block in place of one it freed: the
        workers keep the old id there, and never read it again."""
        kv = self.scheduler.kv_cache_manager
        for request in self.scheduler.running:
            held = kv.get_block_ids(request.req_id)
            tables = self.executor.requests[request.handle].block_ids
            for is_window, engine_ids, worker_ids in zip(
                self.is_window_group, held, tables, strict=True
            ):
                if not is_window:
                    assert list(engine_ids) == worker_ids, (request.req_id, held, tables)
                    continue
                assert len(engine_ids) == len(worker_ids), (request.req_id, held, tables)
                for engine_id, worker_id in zip(engine_ids, worker_ids, strict=True):
                    assert engine_id in (0, worker_id), (request.req_id, held, tables)

    def check_last_step_budget(self, max_tokens_per_request: int, max_num_seqs: int) -> None:
        """The last step gave no request more than `max_tokens_per_request` tokens and ran at
        most `max_num_seqs` requests."""
        if not self.scheduler_outputs:
            return
        counts = list(unpack_int32(self.scheduler_outputs[-1].num_scheduled_tokens))
        assert max(counts, default=0) <= max_tokens_per_request, f"a request got {max(counts)}"
        assert len(counts) <= max_num_seqs, f"{len(counts)} requests in one step"

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def check_no_leaks(self) -> None:
        self.run()
        scheduler = self.scheduler
        assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
        assert not scheduler.running and not scheduler.waiting
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            assert not manager.req_to_blocks, f"block tables left: {list(manager.req_to_blocks)}"
        assert self.free_blocks() == self.num_blocks - 1, (
            f"{self.free_blocks()} free blocks, expected {self.num_blocks - 1}"
        )
        self.core.check_invariants()
        self.executor.check_empty()


MakeHarness = Callable[..., Harness]  # the make_harness fixture of conftest.py
