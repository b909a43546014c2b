"""Scheduler: continuous batching over one KVCacheManager, with chunked prefill and preemption.

It decides which requests run each step and with how many tokens, and turns the workers' sampled
tokens into per-client outputs. It owns its requests' state (no other module advances a request)
and the record of the steps in flight. No I/O: the EngineCore carries its messages.
"""

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from engine_core.kv_cache.hashing import make_block_hasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.sched.admission import NONE_HELD, HeldRequests, RequestIntake, scoped_req_id
from engine_core.sched.block_aligned_chunks import BlockAlignedChunks
from engine_core.sched.client_outputs import final_outputs, group_by_client, rejection
from engine_core.sched.grammar_steps import GrammarSteps
from engine_core.sched.in_flight_step import InFlightStep, StepsInFlight
from engine_core.sched.invariants import check_scheduler
from engine_core.sched.limits import SchedulerLimits, resolve_limits
from engine_core.sched.prompt_logprobs import read_prompt_logprobs
from engine_core.sched.queues import create_request_queue
from engine_core.sched.reply_logprobs import read_reply_logprobs
from engine_core.sched.request import Request, RequestStatus
from engine_core.sched.step_plan import StepPlan
from engine_core.sched.stop import check_stop
from engine_core.sched.validation import max_num_encoder_tokens
from engine_core.structured.manager import StructuredOutputManager
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    TokenLogprobs,
)
from protocol.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from protocol.kv_cache_spec import KVCacheConfig
from protocol.stats import SchedulerStats
from protocol.worker_messages import (
    GrammarBitmask,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Continuous batching: running requests first, then waiting ones, within the step budgets.

    It is the one owner of its requests' state: only this class (and Request's own methods, which
    it calls) changes a Request's fields; tests/unit/test_request_state_owner.py checks it.

    Invariants: `requests` holds exactly the requests in `running` and `waiting`; every running
    request is RUNNING and every waiting one WAITING or PREEMPTED (with no computed tokens);
    `len(running) <= max_num_seqs`; `num_computed_tokens <= num_tokens` for all.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        model_info: ModelInfo,
        enable_kv_cache_events: bool = False,
        limits: SchedulerLimits | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        defers_grammar_bitmask: bool = False,
    ) -> None:
        """`structured_output_manager`: the grammar owner; None refuses constrained requests.
        `defers_grammar_bitmask`: a constrained request keeps its lookahead, its step's bitmask
        following the step (GrammarSteps, grammar_steps.py)."""
        self.scheduler_config = scheduler_config
        self.structured_output_manager = structured_output_manager
        self.grammar = GrammarSteps(structured_output_manager, defers_grammar_bitmask)
        if limits is None:  # the engine passes its startup plan's; in-process callers need not
            limits = resolve_limits(scheduler_config, cache_config, kv_cache_config, model_info)
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size
        self._prefill_cap = limits.prefill_cap
        # Chunks end on block boundaries where an align-mode Mamba group checkpoints its state,
        # and admission reserves no lookahead there (such a group takes a step's slots only).
        self._aligned_chunks = BlockAlignedChunks.for_configs(
            kv_cache_config, cache_config, scheduler_config
        )
        self.policy = scheduler_config.scheduling_policy
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_block_size=self.block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            prefix_cache_retention_interval=cache_config.prefix_cache_retention_interval,
        )
        self.intake = RequestIntake(
            scheduler_config,
            self.max_model_len,
            model_info.vocab_size,
            model_info.eos_token_ids,
            max_num_encoder_tokens(kv_cache_config.kv_cache_groups),
            make_block_hasher(cache_config, self.block_size),
            model_info.prompt_logits_refusal,
        )
        self.admission = self.intake.admission
        self.requests: dict[str, Request] = {}  # by scoped_req_id
        self.running: list[Request] = []
        self.waiting = create_request_queue(self.policy)
        self._finished_handles: list[int] = []  # seen by the workers, to forget next step
        self._step_id = 0
        # The engine's one record of the steps broadcast and not yet answered, oldest first: at
        # most one in the synchronous loop; two with asynchronous scheduling, which schedules
        # step N+1 while the ranks run step N. The EngineCore and the transport ask it.
        self.steps_in_flight = StepsInFlight(2 if scheduler_config.async_scheduling else 1)
        self.num_preemptions = 0
        self.num_logprob_requests = 0  # live requests that asked for logprobs
        self.num_prompt_logprob_requests = 0  # live requests that asked for prompt logprobs
        self.check_each_plan = False  # walk each step's plan before it is built (debugging)

    # ---- admission and aborts -------------------------------------------------------------

    def add_request(
        self,
        request: EngineCoreRequest,
        client_id: bytes,
        compiled_grammar: "xgrammar.CompiledGrammar | None" = None,
        held: HeldRequests = NONE_HELD,
    ) -> EngineCoreOutputs | None:
        """Queue a client's request; a rejection output when its input is bad or the engine is
        full, else None. Ids are scoped by client: two clients may both use "req-1".

        `compiled_grammar`: its structured outputs' grammar, compiled already (the EngineCore
        compiles off the step loop); None compiles it here. `held`: the live requests the
        engine holds outside the scheduler, which count as the scheduler's own do."""
        req_id = scoped_req_id(client_id, request.req_id)
        try:
            state = self.intake.build(
                request,
                client_id,
                len(self.waiting) + held.num_waiting,
                req_id in self.requests or held.is_live,
                held.num_client_live,
            )
        except ValueError as exc:
            logger.warning("rejected request %r: %s", request.req_id, exc)
            return rejection(request.req_id, str(exc))
        # compiled before it is queued: a bad grammar is never scheduled
        if state.sampling_params.structured_outputs is not None:
            error = self.grammar.admit(state, compiled_grammar)
            if error is not None:
                logger.warning("rejected request %r: %s", request.req_id, error)
                return rejection(request.req_id, error)
        self.requests[req_id] = state
        self.num_logprob_requests += state.sampling_params.logprobs is not None
        self.num_prompt_logprob_requests += state.prompt_logprobs is not None
        self.admission.on_admitted(client_id)
        self.waiting.add_request(state)
        return None

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus, error: str | None = None
    ) -> dict[bytes, EngineCoreOutputs]:
        """Finish live requests (aborts, failures); unknown ids are ignored.

        Returns a final output per request, keyed by client, for the server to send or drop.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        doomed = [self.requests[req_id] for req_id in req_ids if req_id in self.requests]
        if not doomed:
            return {}
        doomed_ids = {id(request) for request in doomed}
        self.running = [request for request in self.running if id(request) not in doomed_ids]
        if any(request.status is not _RUNNING for request in doomed):
            self.waiting.remove_requests(doomed)
        for request in doomed:
            self._free_request(request, status)
        return final_outputs(doomed, status.finish_reason, error)

    def abort_client_requests(
        self, client_id: bytes, client_req_ids: list[str], error: str | None = None
    ) -> dict[bytes, EngineCoreOutputs]:
        """Abort a client's own live requests by the ids it gave them; others' are untouchable."""
        req_ids = [scoped_req_id(client_id, req_id) for req_id in client_req_ids]
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED, error)

    def abort_client(self, client_id: bytes, error: str) -> dict[bytes, EngineCoreOutputs]:
        """Abort every live request of one client (it left, or stopped reading its outputs)."""
        if not self.admission.num_live(client_id):
            return {}
        req_ids = [
            request.req_id for request in self.requests.values() if request.client_id == client_id
        ]
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED, error)

    def fail_all(self, error: str) -> dict[bytes, EngineCoreOutputs]:
        """Fail every unfinished request with `error` (a worker died); outputs keyed by client."""
        self.steps_in_flight.forget()  # the steps that failed will never be answered
        return self.finish_requests(list(self.requests), RequestStatus.FINISHED_ERROR, error)

    def requeue_for_new_workers(self) -> None:
        """The worker generation is gone, and every KV block with it (DESIGN.md §8): preempt each
        running request by recompute, keeping its tokens, forget what the workers were told (a
        new generation gets every request whole), and clear the prefix cache, whose blocks hold
        nothing now. The steps in flight, if any, are never answered.

        Each of these preemptions counts in `num_preemptions`, as one under memory pressure does:
        the request loses its KV cache and recomputes it either way (vLLM counts the running
        requests that a reset of the prefix cache preempts alike).
        """
        self.steps_in_flight.forget()
        running, self.running = self.running, []
        for request in reversed(running):  # prepending the last first keeps their order
            self._preempt(request)
        for request in self.requests.values():
            request.num_tokens_sent = 0
            request.num_output_placeholders = 0
        self._finished_handles = []
        if not self.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("blocks are still held after every request was preempted")

    @property
    def next_step_id(self) -> int:
        return self._step_id + 1

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled and not yet updated: 0 or 1, and up to 2 while a step is scheduled
        with asynchronous scheduling."""
        return len(self.steps_in_flight)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """True when the workers still hold requests that finished since the last step."""
        return bool(self._finished_handles)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: running requests first, then admission from the queue."""
        steps_in_flight = self.steps_in_flight
        if not steps_in_flight.can_add():
            step_id = steps_in_flight.oldest().step_id
            raise RuntimeError(f"step {step_id} is in flight: update it first")
        plan = StepPlan()
        budget = self._schedule_running(plan, self.scheduler_config.max_num_batched_tokens)
        if not plan.preempted_handles:  # admitting now would only thrash the pool again
            self._schedule_waiting(plan, budget)
        if self.check_each_plan:
            plan.check_invariants()
        self._step_id += 1
        requests = plan.requests_in_order()
        finished, self._finished_handles = self._finished_handles, []
        # The tier copies its allocations planned (evicted pages down, hits up) ride with it.
        kv_transfers = self.kv_cache_manager.take_kv_transfers(self._step_id)
        output = plan.build(
            self._step_id, finished, self.kv_cache_manager, self.running, kv_transfers
        )
        # Advance only once the message is built: it carries each request's state before the step.
        num_tokens = plan.new_num_tokens + plan.running_num_tokens + plan.resumed_num_tokens
        # each request's chunk (first position, count), for its prompt logprobs in the reply
        chunks = (
            [(r.num_computed_tokens, n) for r, n in zip(requests, num_tokens, strict=True)]
            if self.num_prompt_logprob_requests
            else None
        )
        is_sampling = []
        for request, num_new_tokens in zip(requests, num_tokens, strict=True):
            num_computed = request.num_computed_tokens + num_new_tokens
            request.num_computed_tokens = num_computed
            num_known = len(request.all_token_ids)
            request.num_tokens_sent = num_known
            # A step that reaches the end of the sequence samples its next token: until that
            # token arrives, it is a placeholder the next step may already compute on.
            num_placeholders = request.num_output_placeholders
            samples = num_computed >= num_known + num_placeholders
            request.num_output_placeholders = num_placeholders + samples
            is_sampling.append(samples)
        output, grammar_rows = self.grammar.plan(
            output, requests, is_sampling, bool(steps_in_flight)
        )
        new_handles = pack_int32([new.handle for new in output.scheduled_new_reqs])
        handles = new_handles + output.scheduled_cached_reqs.handles  # as the wire names them
        has_logprobs = self.num_logprob_requests > 0
        steps_in_flight.add(
            InFlightStep(
                self._step_id,
                requests,
                handles,
                is_sampling,
                output,
                has_logprobs,
                chunks,
                grammar_rows,
            )
        )
        return output

    def take_grammar_bitmask(self) -> tuple[int, GrammarBitmask] | None:
        """(step id, bitmask) of the newest step in flight, once its bitmask can follow it
        (GrammarSteps.take_bitmask); None when none is due."""
        return self.grammar.take_bitmask(self.steps_in_flight)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Give each running request its next tokens, preempting when blocks run out."""
        running = self.running
        kv_cache_manager = self.kv_cache_manager
        allocate_slots = kv_cache_manager.allocate_slots
        no_new_blocks = kv_cache_manager.empty_kv_cache_blocks  # what most decode steps get
        prefill_cap = self._prefill_cap
        aligned_chunks = self._aligned_chunks
        # The plan's running columns, filled in step with each other (unschedule_running edits
        # them in place, so these stay the plan's own lists).
        scheduled, scheduled_num_tokens = plan.running_reqs, plan.running_num_tokens
        scheduled_block_ids = plan.running_block_ids
        idx = 0
        while idx < len(running) and budget > 0:
            request = running[idx]
            # Its tokens once the steps in flight answer: the known ones and the placeholders.
            num_placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + num_placeholders
            num_new_tokens = num_tokens - request.num_computed_tokens
            if num_placeholders and (
                num_new_tokens <= 0  # nothing to compute until its last token is known
                # a grammar's next bitmask needs its last token: no lookahead when constrained,
                # unless that bitmask can follow the step
                or self.grammar.skips_lookahead(request)
                # its pending token is its last whatever its value: scheduling past it wastes
                # a slot, and the token sampled there would be dropped
                or check_stop(request, num_tokens, None) is not None
            ):
                idx += 1
                continue
            if prefill_cap and num_new_tokens > prefill_cap:
                num_new_tokens = prefill_cap
            if num_new_tokens > budget:
                num_new_tokens = budget
            if aligned_chunks is not None:
                shared_prefix_boundary = kv_cache_manager.get_shared_prefix_boundary(request.req_id)
                num_new_tokens = aligned_chunks.clip(
                    request, request.num_computed_tokens, num_new_tokens, shared_prefix_boundary
                )
                if not num_new_tokens:  # not even the rest of its block fits this step
                    idx += 1
                    continue
            new_blocks = allocate_slots(request, num_new_tokens)
            while new_blocks is None:
                victim = self._pick_victim()
                # A victim scheduled earlier in this step will not run it: blocks it cached for
                # this step's tokens must leave the index (num_computed_tokens is pre-step here).
                was_scheduled = victim in scheduled
                if was_scheduled:
                    budget += plan.unschedule_running(victim)
                victim_idx = running.index(victim)
                if victim_idx < idx:
                    idx -= 1
                del running[victim_idx]
                self._preempt(victim, victim.num_computed_tokens if was_scheduled else None)
                plan.preempted_handles.append(victim.handle)  # the workers drop its blocks
                logger.debug("preempted %s", victim.handle)
                if victim is request:
                    break
                new_blocks = allocate_slots(request, num_new_tokens)
            if new_blocks is None:
                continue  # the request itself was the victim; running[idx] is the next one
            scheduled.append(request)
            scheduled_num_tokens.append(num_new_tokens)
            # A decode step rarely crosses a block boundary: send None, not empty lists.
            scheduled_block_ids.append(
                None if new_blocks is no_new_blocks else new_blocks.get_block_ids()
            )
            budget -= num_new_tokens
            idx += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting requests in queue order until one does not fit (head of line)."""
        config = self.scheduler_config
        kv_cache_manager = self.kv_cache_manager
        reserves_full_prompt = config.reserve_full_prompt and self._aligned_chunks is None
        while self.waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.prompt_logprobs is None or request.prompt_logprobs.is_complete(
                request.num_prompt_tokens
            ):
                computed_blocks, num_computed = kv_cache_manager.get_computed_blocks(request)
            else:  # cached tokens have no logits (prompt_logprobs.py): compute every one
                computed_blocks, num_computed = kv_cache_manager.empty_kv_cache_blocks, 0
            if computed_blocks.is_waiting_for_disk:  # its disk hits arrive in a step or two
                break
            num_new_tokens = request.num_tokens - num_computed
            if self._prefill_cap and num_new_tokens > self._prefill_cap:
                num_new_tokens = self._prefill_cap
            if num_new_tokens > budget:
                if not config.enable_chunked_prefill:
                    break
                num_new_tokens = budget
            if self._aligned_chunks is not None:
                num_new_tokens = self._aligned_chunks.clip(
                    request, num_computed, num_new_tokens, computed_blocks.shared_prefix_boundary
                )
                if not num_new_tokens:
                    break
            # Reserving the rest of the prompt as lookahead admits only what fits whole.
            num_reserved = request.num_tokens - num_computed - num_new_tokens
            new_blocks = kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_computed,
                new_computed_blocks=computed_blocks,
                num_lookahead_tokens=num_reserved if reserves_full_prompt else 0,
                num_encoder_tokens=request.num_encoder_tokens,  # all at admission, and on resume
            )
            if new_blocks is None:
                break
            self.waiting.pop_request()
            self.running.append(request)
            request.num_computed_tokens = num_computed
            block_ids = kv_cache_manager.get_block_ids(request.req_id)
            if request.num_tokens_sent:  # the workers hold it: its new table replaces the old
                plan.add_resumed(request, num_new_tokens, block_ids)
            else:  # never sent, or lost with a worker generation: it goes out whole
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = num_computed  # as the client sees it, set once
                plan.add_new(request, num_new_tokens, block_ids)
            request.status = _RUNNING
            budget -= num_new_tokens

    def _pick_victim(self) -> Request:
        """FCFS: the last running request; priority: the largest (priority, arrival_time)."""
        if self.policy == SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda request: (request.priority, request.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, num_written_tokens: int | None = None) -> None:
        """Preempt a request the caller took out of `running`, by recompute: free its blocks,
        reset its progress and queue it first; its tokens are kept. The one path of both kinds,
        for blocks that ran out and for a lost worker generation, and both count.

        `num_written_tokens`: the tokens whose K/V the ranks hold or will write, when fewer than
        its cached blocks cover: it was scheduled earlier in the step being planned, which it
        will not run, so blocks cached for that step's tokens leave the prefix-cache index.
        """
        self.kv_cache_manager.free(request, num_written_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[bytes, EngineCoreOutputs]:
        """Answer the oldest step in flight: append each request's sampled token, apply the stop
        rule, free the requests that finished, and build client outputs. The reply's logprobs
        (reply_logprobs.py) go out with their tokens."""
        step = self.steps_in_flight.pop_answered(scheduler_output, model_runner_output)
        if model_runner_output.failed_disk_slots or scheduler_output.kv_transfers is not None:
            self.kv_cache_manager.on_step_reply(step.step_id, model_runner_output.failed_disk_slots)
        sampled = unpack_int32(model_runner_output.sampled_token_ids)
        logprobs: list[TokenLogprobs | None]
        if step.has_logprobs or model_runner_output.sampled_token_ranks:
            logprobs = read_reply_logprobs(
                model_runner_output, step.requests, step.is_sampling, sampled
            )
        else:
            logprobs = [None] * len(step.requests)
        if step.chunks is not None:
            self._gather_prompt_logprobs(model_runner_output, step.requests, step.chunks)
        outputs: defaultdict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        finished: list[Request] = []
        finished_while_preempted: list[Request] = []
        for request, token_id, samples, token_logprobs in zip(
            step.requests, sampled, step.is_sampling, logprobs, strict=True
        ):
            if not samples:
                continue  # a partial prefill chunk: its sample means nothing
            status = request.status
            # Aborted, or stopped a step earlier: a token past its end, dropped with its logprobs.
            if status is not _RUNNING and status.is_finished:
                continue
            # Running, or preempted while this step ran: the token is valid either way, and
            # the workers appended it to their copy of the sequence as they sampled it.
            request.num_output_placeholders -= 1
            request.append_output_token_id(token_id)
            request.num_tokens_sent += 1
            finish_reason = error = None
            finished_status = None
            if request.sampling_params.structured_outputs is not None:
                finished_status, error = self.grammar.advance(request, token_id)
            if finished_status is None:
                finished_status = check_stop(request, len(request.all_token_ids), token_id)
            if finished_status is not None:
                finish_reason = finished_status.finish_reason
                finished.append(request)
                if status is not _RUNNING:  # preempted while the step ran: it waits in the queue
                    finished_while_preempted.append(request)
                request.status = finished_status
            prompt_logprobs = request.prompt_logprobs
            outputs[request.client_id].append(
                EngineCoreOutput(
                    request.client_req_id,
                    [token_id],
                    finish_reason,
                    request.num_cached_tokens,
                    error,
                    token_logprobs,
                    None
                    if prompt_logprobs is None or prompt_logprobs.is_sent
                    else prompt_logprobs.take(),  # complete: the prompt's last chunk sampled
                )
            )
        if finished:
            if finished_while_preempted:
                self.waiting.remove_requests(finished_while_preempted)
            self.running = [request for request in self.running if request.status is _RUNNING]
            for request in finished:
                self._free_request(request, request.status)
        return group_by_client(outputs)

    def _gather_prompt_logprobs(
        self, output: ModelRunnerOutput, requests: list[Request], chunks: list[tuple[int, int]]
    ) -> None:
        """Add the reply's prompt logprobs to their requests (prompt_logprobs.py); those of a
        request that finished meanwhile are dropped."""
        entries = read_prompt_logprobs(
            output,
            [request.sampling_params.prompt_logprobs for request in requests],
            chunks,
            [request.num_prompt_tokens for request in requests],
        )
        for request, (first_position, _), request_entries in zip(
            requests, chunks, entries, strict=True
        ):
            prompt_logprobs = request.prompt_logprobs
            if request_entries is None or prompt_logprobs is None or prompt_logprobs.is_sent:
                continue
            prompt_logprobs.add(first_position + 1, request_entries)

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        """Finish a request that is out of the queues: release blocks, forget it."""
        request.status = status
        self.kv_cache_manager.free(request)
        self.grammar.forget(request)
        del self.requests[request.req_id]
        self.num_logprob_requests -= request.sampling_params.logprobs is not None
        self.num_prompt_logprob_requests -= request.prompt_logprobs is not None
        self.admission.on_finished(request.client_id)
        if request.num_tokens_sent:
            self._finished_handles.append(request.handle)

    # ---- management -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> tuple[bool, str | None]:
        """Clear the prefix cache; fails with the reason while requests hold blocks."""
        if self.running:
            reason = f"running requests hold blocks ({len(self.running)} running, expected 0)"
            return False, f"cannot reset the prefix cache: {reason}"
        if not self.kv_cache_manager.reset_prefix_cache():
            return False, "cannot reset the prefix cache: blocks are still in use"
        return True, None

    def make_load(self) -> dict[str, int]:
        """The outstanding work a front end weighs when it routes: prompt tokens still to compute
        (a waiting request's whole sequence less what is computed, a running one's prompt less
        what is computed) and the running requests past their prompt. Cheap: no cache lookups."""
        waiting_prefill_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        running_decodes = 0
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                waiting_prefill_tokens += request.num_prompt_tokens - request.num_computed_tokens
            else:
                running_decodes += 1
        return {
            "waiting_prefill_tokens": waiting_prefill_tokens,
            "running_decodes": running_decodes,
        }

    def make_stats(self) -> SchedulerStats:
        """Current counts and totals since start; the KV-cache manager owns the prefix-cache
        totals, so this only reads and may be called any number of times."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            num_steps=self._step_id,
            prefix_cache=self.kv_cache_manager.make_prefix_cache_stats(),
        )

    def check_invariants(self) -> None:
        check_scheduler(self)
