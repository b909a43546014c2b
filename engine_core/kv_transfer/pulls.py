"""KVTransferPulls: a decode engine's requests waiting for their prompt's KV (DESIGN.md §12).

A request that arrives with a `KVTransferHandle` is parked here instead of being queued. Its
prompt's full blocks are hashed as the scheduler would hash them, and the prefix hit to build is
planned in every KV-cache group, up to the last full block before the prompt's last token
(admission would recompute that one anyway, for its logits): every block of a full-attention
group, and of a sliding-window group only the blocks the window of the hit's next token reaches
(first_needed_block). Blocks this engine caches already stay (referenced, so nothing evicts them
meanwhile), and fresh blocks are taken for the rest; a needed block the prefill engine no longer
holds (the null block in the handle) means no pull at all. The next step tells every rank to
pull the fresh blocks from its peer rank of the prefill engine; the ranks pull beside the steps
that follow (no step touches the fresh blocks) and each reports the pull's end once. When every
rank has reported it:

- every rank pulled: the fresh blocks get their hashes (KV events announce them) and every block
  is freed into the prefix cache, then the request is queued. Admission finds the whole run as a
  prefix hit, so the request joins the running batch with only its last prompt tokens to compute;
- some rank failed (the prefill engine died, refused the handle, or timed out): the fresh blocks
  are freed unhashed and the request is queued all the same. It computes its prompt itself:
  the transfer is lost, never the answer.

Between the pull and admission nothing else runs, so only requests queued ahead of it in that same
schedule can evict the pulled blocks, which costs recomputation, never tokens.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.sched.request import Request
from protocol.client_messages import EngineCoreRequest
from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from protocol.kv_transfer import (
    KVPull,
    KVTransferLayout,
    KVTransferOrders,
    describe_pair_mismatch,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class GroupRun:
    """One KV-cache group's part of the hit a pull builds: the blocks from `first` to the hit's
    end, each cached here already or freshly pulled (`is_fresh`)."""

    group_id: int
    first: int  # blocks before it are none of the hit's business (a sliding window's past)
    blocks: list[KVCacheBlock]  # filled once the fresh blocks are taken
    is_fresh: list[bool]


def first_needed_block(spec: KVCacheSpec, num_hit_blocks: int) -> int:
    """The first block a group needs cached for a prefix hit of `num_hit_blocks` blocks: every
    block for full attention; for a sliding window only the blocks the window of the hit's next
    token reaches back into (the prefill engine may have dropped the earlier ones), as the
    sliding-window hit search asks."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_hit_blocks - cdiv(spec.sliding_window - 1, spec.block_size))
    return 0


def _with_gaps(run: GroupRun) -> list[KVCacheBlock | None]:
    """The run's local blocks in order, None where a fresh one goes."""
    local = iter(run.blocks)
    return [None if is_fresh else next(local) for is_fresh in run.is_fresh]


@dataclass(slots=True, eq=False)
class ParkedRequest:
    """A request whose pull is planned or in flight."""

    request: EngineCoreRequest
    client_id: bytes
    hashed: Request  # the prompt hashed as the scheduler would; never scheduled
    blocks: list[KVCacheBlock]  # local hits, then the fresh blocks pulled into; one ref each
    num_local_blocks: int  # leading blocks of `blocks` that were cached here already
    pull: KVPull
    start_s: float  # time.perf_counter() when it was parked
    runs: list[GroupRun]  # per KV-cache group, the blocks of the hit the pull builds
    num_hit_blocks: int  # the hit's length in blocks, in every group
    is_sent: bool = False  # its pull rode a step to the ranks
    num_ranks_done: int = 0  # ranks that reported the pull ended
    is_failed: bool = False  # some rank reported it failed
    is_aborted: bool = False


@dataclass(slots=True)
class PullStats:
    """Totals since start, for stats and metrics."""

    num_pulls: int = 0  # completed on every rank
    num_failed: int = 0  # planned and not completed: the request computed its prompt
    num_skipped: int = 0  # handles not pulled at all (mismatched layout, no room, all cached)
    num_blocks: int = 0  # blocks pulled
    num_bytes: int = 0  # bytes pulled, every rank together
    pull_seconds: list[float] = field(default_factory=list)  # parked to pulled, not yet taken


class KVTransferPulls:
    """The parked requests of one decode engine, by scoped req_id.

    Invariants: each parked request holds one reference on each of its blocks; a request is
    parked here or known to the scheduler, never both.
    """

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        layout: KVTransferLayout,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
    ) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.groups = list(kv_cache_groups)
        self.layout = layout
        self.parked: dict[str, ParkedRequest] = {}
        self.by_pull_id: dict[int, ParkedRequest] = {}
        self.stats = PullStats()
        self._next_pull_id = 1

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every block a parked request references (the coordinator's invariant counts them)."""
        return [block for parked in self.parked.values() for block in parked.blocks]

    def has_orders(self) -> bool:
        """Pulls not sent to the ranks yet: a step must go out even if nothing runs."""
        return any(not parked.is_sent for parked in self.parked.values())

    def is_pulling(self) -> bool:
        """Pulls sent and not yet reported by every rank: steps must keep going to hear them."""
        return any(parked.is_sent for parked in self.parked.values())

    def take_orders(self) -> KVTransferOrders | None:
        """The unsent pulls, for the step about to go out."""
        pulls = []
        for parked in self.parked.values():
            if not parked.is_sent:
                parked.is_sent = True
                pulls.append(parked.pull)
        return KVTransferOrders(pulls=pulls) if pulls else None

    def park(
        self, req_id: str, hashed: Request, request: EngineCoreRequest, client_id: bytes
    ) -> bool:
        """Plan the pull of a request with a handle; False when there is nothing to pull (the
        caller queues it at once): a layout that differs, caching off, no room, a block the hit
        needs that the prefill engine no longer holds, or every block to pull already cached
        here. `hashed`: the request as the scheduler would build it (the intake checked it), for
        its block hashes; it is never scheduled."""
        handle = request.kv_transfer_handle
        assert handle is not None, "park a request that carries a handle"
        refusal = self._refusal(request)
        if refusal is not None:
            logger.warning("not pulling the KV of %r: %s", request.req_id, refusal)
            self.stats.num_skipped += 1
            return False
        # admission computes the last prompt token whatever is cached, so the block that holds it
        # is never a hit: the hit to build ends at the last full block before it
        num_per_group = len(handle.block_ids) // len(self.groups)
        num_blocks = min((hashed.num_prompt_tokens - 1) // self.block_size, num_per_group)
        num_blocks = min(num_blocks, len(hashed.block_hashes))
        pool = self.block_pool
        runs: list[GroupRun] = []
        local: list[KVCacheBlock] = []
        src_ids: list[int] = []
        src_idxs: list[int] = []  # where each of src_ids lies in handle.block_ids
        for group_id, group in enumerate(self.groups):
            first = first_needed_block(group.spec, num_blocks)
            run = GroupRun(group_id, first, [], [])
            for idx in range(first, num_blocks):
                cached = pool.get_cached_block(hashed.block_hashes[idx], [group_id])
                run.is_fresh.append(cached is None)
                if cached is not None:
                    run.blocks.append(cached[0])
                    local.append(cached[0])
                    continue
                src = handle.block_ids[group_id * num_per_group + idx]
                if src == NULL_BLOCK_ID:
                    logger.warning(
                        "not pulling the KV of %r: the prefill engine's sliding window dropped "
                        "block %d of KV-cache group %d, which the hit needs",
                        request.req_id,
                        idx,
                        group_id,
                    )
                    self.stats.num_skipped += 1
                    return False
                src_ids.append(src)
                src_idxs.append(group_id * num_per_group + idx)
            runs.append(run)
        num_fresh = len(src_ids)
        if num_fresh == 0 or num_fresh > pool.get_num_free_blocks() - len(local):
            self.stats.num_skipped += 1
            return False
        pool.touch(local)
        fresh = pool.get_new_blocks(num_fresh)
        fresh_iter = iter(fresh)
        for run in runs:  # the fresh blocks in the places planned for them
            run.blocks = [
                next(fresh_iter) if is_fresh else block
                for block, is_fresh in zip(_with_gaps(run), run.is_fresh, strict=True)
            ]
        pull_id, self._next_pull_id = self._next_pull_id, self._next_pull_id + 1
        is_run = src_idxs == list(range(src_idxs[0], src_idxs[0] + num_fresh))
        pull = KVPull(
            pull_id,
            handle.transfer_id,
            handle.secret,
            list(handle.endpoints),
            src_idxs[0],
            src_ids,
            [block.block_id for block in fresh],
            self.layout,
            [] if is_run else src_idxs,
        )
        parked = ParkedRequest(
            request,
            client_id,
            hashed,
            [*local, *fresh],
            len(local),
            pull,
            time.perf_counter(),
            runs,
            num_blocks,
        )
        self.parked[req_id] = self.by_pull_id[pull_id] = parked
        return True

    def _refusal(self, request: EngineCoreRequest) -> str | None:
        handle = request.kv_transfer_handle
        assert handle is not None
        if not self.block_pool.enable_caching:
            return "prefix caching is off on this decode engine"
        mismatch = describe_pair_mismatch(handle.layout, self.layout)
        if mismatch is not None:
            return f"the prefill engine's KV layout differs ({mismatch})"
        num_prompt_tokens = len(request.prompt_token_ids) // 4
        if handle.num_tokens != num_prompt_tokens:
            return (
                f"the handle's num_tokens {handle.num_tokens} != the prompt's {num_prompt_tokens}"
            )
        if len(handle.block_ids) % len(self.groups):
            return (
                f"the handle's block_ids hold {len(handle.block_ids)} ids: expected one equal run "
                f"per KV-cache group, of {len(self.groups)}"
            )
        if len(handle.endpoints) != handle.layout.tp_size:
            return (
                f"the handle's endpoints name {len(handle.endpoints)} ranks: expected its "
                f"layout's tp_size {handle.layout.tp_size}"
            )
        return None

    def take_pull_seconds(self) -> list[float]:
        """Parked-to-pulled times of the pulls completed since the last call, for metrics."""
        seconds, self.stats.pull_seconds = self.stats.pull_seconds, []
        return seconds

    def on_step_reply(
        self, finished_pull_ids: list[int], failed_pull_ids: list[int], num_bytes: int
    ) -> list[ParkedRequest]:
        """Count the ranks' reports of ended pulls (a pull id once per rank); settle each pull
        every rank has reported, and return the requests to queue now (aborted ones are settled
        and dropped). A pull completes only if no rank failed it."""
        self.stats.num_bytes += num_bytes
        failed = set(failed_pull_ids)
        settled = []
        for pull_id in finished_pull_ids:
            parked = self.by_pull_id.get(pull_id)
            if parked is None:
                continue  # settled already (the generation that ran it was lost)
            parked.num_ranks_done += 1
            parked.is_failed |= pull_id in failed
            if parked.num_ranks_done == self.layout.tp_size:
                self._forget(parked)
                self._settle(parked, not parked.is_failed)
                settled.append(parked)
        return [parked for parked in settled if not parked.is_aborted]

    def _forget(self, parked: ParkedRequest) -> None:
        del self.parked[parked.hashed.req_id]
        del self.by_pull_id[parked.pull.pull_id]

    def _settle(self, parked: ParkedRequest, is_pulled: bool) -> None:
        blocks, num_local = parked.blocks, parked.num_local_blocks
        if is_pulled:
            pool = self.block_pool
            null = pool.null_block
            for run in parked.runs:  # hash the pulled blocks in their places (the others have
                # theirs already, and a null block is skipped)
                pulled = [
                    block if is_fresh else null
                    for block, is_fresh in zip(run.blocks, run.is_fresh, strict=True)
                ]
                pool.cache_full_blocks(
                    parked.hashed,
                    [null] * run.first + pulled,
                    run.first,
                    parked.num_hit_blocks,
                    self.block_size,
                    run.group_id,
                )
            self.stats.num_pulls += 1
            self.stats.num_blocks += len(blocks) - num_local
            self.stats.pull_seconds.append(time.perf_counter() - parked.start_s)
        else:
            self.stats.num_failed += 1
            logger.warning(
                "pulling the KV of %r failed: it computes its prompt here", parked.request.req_id
            )
        self.block_pool.free_blocks(reversed(blocks))

    def abort(self, req_id: str) -> ParkedRequest | None:
        """The client aborted a parked request: it is never queued. Its pull, if in flight,
        still settles (the ranks write its blocks either way)."""
        parked = self.parked.get(req_id)
        if parked is None or parked.is_aborted:
            return None
        parked.is_aborted = True
        if not parked.is_sent:  # nothing writes its blocks
            self._forget(parked)
            self.block_pool.free_blocks(reversed(parked.blocks))
        return parked

    def is_live(self, req_id: str) -> bool:
        parked = self.parked.get(req_id)
        return parked is not None and not parked.is_aborted

    def fail_all(self) -> list[ParkedRequest]:
        """The worker generation is lost: no pull completes. Free every block; the live parked
        requests, to queue (they compute their prompts on the new generation)."""
        parked = list(self.parked.values())
        self.parked.clear()
        self.by_pull_id.clear()
        for one in parked:
            self._settle(one, is_pulled=False)
        return [one for one in parked if not one.is_aborted]

    def check_invariants(self) -> None:
        assert len(self.by_pull_id) == len(self.parked), "a parked request without its pull"
        for req_id, parked in self.parked.items():
            assert parked.hashed.req_id == req_id, f"{req_id} parked as {parked.hashed.req_id}"
            assert self.by_pull_id[parked.pull.pull_id] is parked, f"{req_id}'s pull id"
            assert parked.num_ranks_done < self.layout.tp_size, f"{req_id}'s pull is settled"
            for block in parked.blocks:
                assert block.ref_cnt >= 1, f"{req_id} holds a free block {block}"
