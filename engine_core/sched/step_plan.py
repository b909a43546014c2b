"""StepPlan: what one schedule() decided, turned into the SchedulerOutput broadcast to workers.

The wire Structs are built once per step from int32 columns. Nothing here allocates blocks or
changes a request: the Scheduler advances requests once the message is built.
"""

from array import array
from dataclasses import dataclass, field

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.sched.request import Request
from protocol.buffers import pack_int32
from protocol.worker_messages import (
    CachedRequestData,
    KVTransfers,
    NewRequestData,
    SchedulerOutput,
)

BlockIds = tuple[list[int], ...]  # one list of block ids per KV-cache group


@dataclass(slots=True, eq=False)
class StepPlan:
    """The requests one step runs, with their token counts and block ids, in wire order.

    Invariants: each `*_num_tokens` list is as long as its request list; a request appears in
    at most one of `new_reqs`, `running_reqs` and `resumed_reqs`.
    """

    new_reqs: list[Request] = field(default_factory=list)
    new_num_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[BlockIds] = field(default_factory=list)  # whole tables
    running_reqs: list[Request] = field(default_factory=list)
    running_num_tokens: list[int] = field(default_factory=list)
    running_block_ids: list[BlockIds | None] = field(default_factory=list)  # appended; None if none
    resumed_reqs: list[Request] = field(default_factory=list)
    resumed_num_tokens: list[int] = field(default_factory=list)
    resumed_block_ids: list[BlockIds] = field(default_factory=list)  # whole replacement tables
    preempted_handles: list[int] = field(default_factory=list)

    def check_invariants(self) -> None:
        for requests, counts in (
            (self.new_reqs, self.new_num_tokens),
            (self.running_reqs, self.running_num_tokens),
            (self.resumed_reqs, self.resumed_num_tokens),
        ):
            assert len(requests) == len(counts), f"{len(requests)} requests, {len(counts)} counts"
        assert len(self.new_block_ids) == len(self.new_reqs), "a new request lacks its table"
        assert len(self.running_block_ids) == len(self.running_reqs), "running block ids misalign"
        assert len(self.resumed_block_ids) == len(self.resumed_reqs), "a resumed request lacks one"
        ids = [id(request) for request in self.requests_in_order()]
        assert len(ids) == len(set(ids)), "a request is scheduled twice in one step"

    def add_new(self, request: Request, num_tokens: int, block_ids: BlockIds) -> None:
        """Schedule a request the workers do not hold: it goes out whole, with its table."""
        self.new_reqs.append(request)
        self.new_num_tokens.append(num_tokens)
        self.new_block_ids.append(block_ids)

    def add_resumed(self, request: Request, num_tokens: int, block_ids: BlockIds) -> None:
        """Schedule a preempted request the workers still hold: `block_ids` replace its table."""
        self.resumed_reqs.append(request)
        self.resumed_num_tokens.append(num_tokens)
        self.resumed_block_ids.append(block_ids)

    def unschedule_running(self, request: Request) -> int:
        """Drop a running request scheduled earlier in this step; returns its token count."""
        idx = self.running_reqs.index(request)
        del self.running_reqs[idx]
        del self.running_block_ids[idx]
        return self.running_num_tokens.pop(idx)

    def requests_in_order(self) -> list[Request]:
        """Every scheduled request in SchedulerOutput order: new, then running, then resumed."""
        return self.new_reqs + self.running_reqs + self.resumed_reqs

    def build(
        self,
        step_id: int,
        finished_handles: list[int],
        kv_cache_manager: KVCacheManager | None = None,
        running: list[Request] | None = None,
        kv_transfers: KVTransfers | None = None,
    ) -> SchedulerOutput:
        """The wire message, read from each request as it stood before this step; writes nothing.

        The Scheduler advances `num_computed_tokens` and `num_tokens_sent` once it is built. The
        common prefix is read from the pool as this step's allocations left it, which is what
        the workers' tables hold when they run this step, whatever steps are still in flight.
        Without the pool and the running requests it reports none.
        """
        new_reqs_data = [
            _new_request_data(request, block_ids)
            for request, block_ids in zip(self.new_reqs, self.new_block_ids, strict=True)
        ]
        cached_reqs = self.running_reqs + self.resumed_reqs
        cached_num_tokens = self.running_num_tokens + self.resumed_num_tokens
        cached = _cached_request_data(
            cached_reqs,
            self.running_block_ids + self.resumed_block_ids,
            [request.handle for request in self.resumed_reqs],
        )
        num_scheduled_tokens = array("i", self.new_num_tokens)
        num_scheduled_tokens.extend(cached_num_tokens)
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=pack_int32(num_scheduled_tokens),
            total_num_scheduled_tokens=sum(num_scheduled_tokens),
            finished_handles=finished_handles,
            preempted_handles=self.preempted_handles,
            num_common_prefix_blocks=(
                []
                if kv_cache_manager is None or running is None
                else num_common_prefix_blocks(kv_cache_manager, running)
            ),
            kv_transfers=kv_transfers,
        )


def num_common_prefix_blocks(kv_cache_manager: KVCacheManager, running: list[Request]) -> list[int]:
    """Per group, the leading blocks every running request holds, as vLLM's scheduler asks it
    of one running request; [] when nothing can be shared (no prefix cache, or one request).

    Every request that holds blocks is running here (a preempted or finished one was freed), so
    a block whose ref_cnt is the number of running requests is in every running table.
    """
    if not kv_cache_manager.enable_caching or len(running) < 2:
        return []
    return kv_cache_manager.get_num_common_prefix_blocks(running[0].req_id, len(running))


def _new_request_data(request: Request, block_ids: BlockIds) -> NewRequestData:
    return NewRequestData(
        handle=request.handle,
        prompt_token_ids=pack_int32(request.all_token_ids),
        sampling_params=request.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=request.num_computed_tokens,
        encoder_token_ids=(
            None if request.encoder_token_ids is None else pack_int32(request.encoder_token_ids)
        ),
        num_prompt_tokens=(
            None
            if request.num_prompt_tokens == len(request.all_token_ids)
            else request.num_prompt_tokens
        ),
    )


def _cached_request_data(
    requests: list[Request],
    new_block_ids: list[BlockIds | None],
    resumed_handles: list[int],
) -> CachedRequestData:
    """Columns of the requests the workers already hold; decode steps take the one-token path.

    Each column is one comprehension over the requests, not an append per request and column.
    """
    handles = array("i", [request.handle for request in requests])
    num_computed = array("i", [request.num_computed_tokens for request in requests])
    num_new_token_ids = array(
        "i", [len(request.all_token_ids) - request.num_tokens_sent for request in requests]
    )
    if num_new_token_ids.count(1) == len(num_new_token_ids):  # every one sent all but its last
        new_token_ids = array("i", [request.all_token_ids[-1] for request in requests])
    else:
        new_token_ids = array("i")
        for request, num_unsent in zip(requests, num_new_token_ids, strict=True):
            if num_unsent:
                new_token_ids.extend(request.all_token_ids[request.num_tokens_sent :])
    return CachedRequestData(
        handles=pack_int32(handles),
        resumed_handles=resumed_handles,
        new_token_ids=pack_int32(new_token_ids),
        num_new_token_ids=pack_int32(num_new_token_ids),
        new_block_ids=new_block_ids,
        num_computed_tokens=pack_int32(num_computed),
    )
