"""EngineCore: the step loop of schedule, execute and update, over a pluggable Executor.

It owns the Scheduler (and through it the only BlockPool, and the one record of the steps in
flight) and never touches a socket: the server supplies an Executor that broadcasts each
SchedulerOutput and gathers the ranks' replies.
"""

import logging
from time import perf_counter

import msgspec

from engine_core.executors import Executor, PipelinedExecutor, SerialPipeline
from engine_core.kv_transfer.agent import KVTransferAgent
from engine_core.sched.admission import HeldRequests, scoped_req_id
from engine_core.sched.client_outputs import rejection
from engine_core.sched.limits import SchedulerLimits
from engine_core.sched.scheduler import Scheduler
from engine_core.structured.compiling import CompilingRequests
from engine_core.structured.manager import build_structured_output_manager
from protocol.client_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    StatValue,
)
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_events import KVCacheEvent
from protocol.kv_transfer import kv_transfer_layout
from protocol.stats import BlockResidencyStats, SchedulerStats, stat_values
from protocol.worker_messages import ModelInfo, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """One engine: requests in, a step at a time, outputs out, keyed by client id.

    Invariants: those of its Scheduler and KV-cache manager, walked after each step when
    `engine_config.check_invariants` is set.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        model_info: ModelInfo,
        executor: Executor,
        limits: SchedulerLimits | None = None,
    ) -> None:
        """`limits`: the startup plan's (service/plan.py); resolved here when not given."""
        self.engine_config = engine_config
        self.kv_cache_config = kv_cache_config  # as agreed at startup; every generation keeps it
        self.model_info = model_info
        self.executor = executor
        self._pipeline: PipelinedExecutor | None = None  # asynchronous scheduling only
        if engine_config.scheduler.async_scheduling:
            is_pipelined = isinstance(executor, PipelinedExecutor)
            self._pipeline = executor if is_pipelined else SerialPipeline(executor)
        # The steps sent and not yet collected are the scheduler's record (steps_in_flight).
        # A failure sending the step queued behind an applied one, raised once that one's
        # outputs are out (the next call of `step`).
        self._send_error: Exception | None = None
        self.scheduler = Scheduler(
            engine_config.scheduler,
            engine_config.cache,
            kv_cache_config,
            model_info,
            enable_kv_cache_events=engine_config.kv_events.enable_kv_cache_events,
            limits=limits,
            structured_output_manager=build_structured_output_manager(
                engine_config.tokenizer, model_info
            ),
            defers_grammar_bitmask=self._pipeline is not None,
        )
        self._check_each_step = engine_config.check_invariants
        self.schedule_time_s = 0.0  # total seconds in Scheduler.schedule
        self.update_time_s = 0.0  # total seconds in Scheduler.update_from_output
        self.scheduler.check_each_plan = engine_config.check_invariants
        if engine_config.cache.kv_cache_metrics:
            self.scheduler.kv_cache_manager.enable_block_metrics(
                engine_config.cache.kv_cache_metrics_sample
            )
        # Disaggregated prefill and decode (DESIGN.md §12): a prefill engine pins blocks for
        # decode engines, a decode engine pulls them; an engine of role "both" does neither.
        self.kv_transfer_layout = kv_transfer_layout(
            model_info.name, kv_cache_config, engine_config.tp_size, model_info.fingerprint
        )
        manager = self.scheduler.kv_cache_manager
        self.kv_transfer = KVTransferAgent(
            engine_config,
            manager.block_pool,
            self.scheduler.block_size,
            self.kv_transfer_layout,
            kv_cache_config.kv_cache_groups,
        )
        manager.coordinator.block_holders.extend(self.kv_transfer.block_holders())
        # outputs made between steps (a parked request refused once its pull settled), sent
        # with the next step's
        self._deferred_outputs: dict[bytes, list[EngineCoreOutput]] = {}
        # Constrained requests whose grammars compile off the step loop: each is queued once
        # its grammar is ready (a large schema takes seconds, which would stall every running
        # request if compiled in a step), or refused with the reason. None: no grammars.
        manager = self.scheduler.structured_output_manager
        self.compiling = None if manager is None else CompilingRequests(manager)

    def add_request(
        self, request: EngineCoreRequest, client_id: bytes = b""
    ) -> EngineCoreOutputs | None:
        """Queue a request; a rejection output for its client when the input is bad.

        On a decode engine a request with a KV transfer handle is parked until its pull settles;
        on a prefill engine a do_remote_decode request will be pinned (KVTransferPins)."""
        scheduler, pins, pulls = self.scheduler, self.kv_transfer.pins, self.kv_transfer.pulls
        if request.kv_transfer_handle is not None and pulls is not None:
            req_id = scoped_req_id(client_id, request.req_id)
            is_live = self.is_live(client_id, request.req_id)
            try:  # a request it would refuse is refused now, by scheduler.add_request below
                hashed = scheduler.intake.build(request, client_id, len(scheduler.waiting), is_live)
            except ValueError:
                hashed = None
            if hashed is not None and pulls.park(req_id, hashed, request, client_id):
                return None
        spec = request.sampling_params.structured_outputs
        compiling = self.compiling
        # the requests whose grammars compile are live and waiting: an id or a share they hold
        # is not free, whether the new request is constrained or not
        held = HeldRequests(
            len(compiling or ()),
            compiling.num_by_client.get(client_id, 0) if compiling is not None else 0,
            self.is_live(client_id, request.req_id),
        )
        if spec is not None and compiling is not None and not request.do_remote_decode:
            num_waiting = len(scheduler.waiting) + held.num_waiting
            try:  # a request it would refuse is refused now, by scheduler.add_request below
                scheduler.intake.build(
                    request, client_id, num_waiting, held.is_live, held.num_client_live
                )
            except ValueError:
                pass
            else:
                compiling.start(scoped_req_id(client_id, request.req_id), request, client_id, spec)
                return None
        refusal = scheduler.add_request(request, client_id, held=held)
        if refusal is None and request.do_remote_decode and pins is not None:
            pins.want(scoped_req_id(client_id, request.req_id))
        return refusal

    def abort_requests(
        self, req_ids: list[str], client_id: bytes = b""
    ) -> dict[bytes, EngineCoreOutputs]:
        """Abort a client's own live requests between steps, by the ids that client gave them;
        ids it does not hold are ignored. Final outputs by client."""
        outputs = self.scheduler.abort_client_requests(client_id, req_ids)
        for req_id in req_ids:
            self._abort_parked(scoped_req_id(client_id, req_id), None, outputs)
            self._end_compiling(scoped_req_id(client_id, req_id), None, outputs)
        return self.kv_transfer.with_handles(outputs)

    def abort_client(self, client_id: bytes, error: str) -> dict[bytes, EngineCoreOutputs]:
        """Abort every live request of a client that left or stopped reading, freeing blocks."""
        outputs = self.scheduler.abort_client(client_id, error)
        if (pulls := self.kv_transfer.pulls) is not None:
            for req_id, parked in list(pulls.parked.items()):
                if parked.client_id == client_id:
                    self._abort_parked(req_id, error, outputs)
        for req_id, held in self.compiling or ():
            if held.client_id == client_id:
                self._end_compiling(req_id, error, outputs)
        return self.kv_transfer.with_handles(outputs)

    def _end_compiling(
        self,
        req_id: str,
        error: str | None,
        outputs: dict[bytes, EngineCoreOutputs],
        finish_reason: FinishReason = FinishReason.ABORT,
    ) -> None:
        """End a request whose grammar is compiling, adding its final output to `outputs`."""
        if self.compiling is None:
            return
        if (ended := self.compiling.end(req_id, finish_reason, error)) is None:
            return
        client_id, final = ended
        batch = outputs.get(client_id)
        outputs[client_id] = EngineCoreOutputs([*(batch.outputs if batch else []), final])

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammars compiled, and refuse those that did not compile."""
        if self.compiling is None or not self.compiling.has_ready():
            return
        for held, compiled in self.compiling.take_ready():
            request, client_id = held.request, held.client_id
            if isinstance(compiled, str):
                logger.warning("rejected request %r: %s", request.req_id, compiled)
                refusal: EngineCoreOutputs | None = rejection(request.req_id, compiled)
            else:
                refusal = self.scheduler.add_request(request, client_id, compiled)
            if refusal is not None:
                self._defer(client_id, refusal)

    @property
    def grammar_wake_fd(self) -> int | None:
        """Readable once a grammar compiled off the step loop is ready; None without grammars."""
        return None if self.compiling is None else self.compiling.manager.fileno()

    def close(self) -> None:
        """Stop the grammar compile thread; the engine serves no more steps."""
        if self.compiling is not None:
            self.compiling.manager.close()

    def _abort_parked(
        self, req_id: str, error: str | None, outputs: dict[bytes, EngineCoreOutputs]
    ) -> None:
        """Abort a request parked for its pull, adding its final output to `outputs`."""
        pulls = self.kv_transfer.pulls
        if pulls is None or (parked := pulls.abort(req_id)) is None:
            return
        final = EngineCoreOutput(parked.request.req_id, [], FinishReason.ABORT, 0, error)
        batch = outputs.get(parked.client_id)
        previous = batch.outputs if batch is not None else []
        outputs[parked.client_id] = EngineCoreOutputs([*previous, final])

    def is_live(self, client_id: bytes, req_id: str) -> bool:
        """Whether the client holds a live request it named `req_id`."""
        scoped = scoped_req_id(client_id, req_id)
        if (pulls := self.kv_transfer.pulls) is not None and pulls.is_live(scoped):
            return True
        return scoped in self.scheduler.requests or scoped in (self.compiling or ())

    def has_work(self) -> bool:
        """Requests to run, finished ones the workers must still be told to drop, or a step
        whose answer has not been collected."""
        scheduler = self.scheduler
        return (
            scheduler.has_unfinished_requests()
            or scheduler.has_finished_requests()
            or scheduler.num_steps_in_flight > 0
            or self._send_error is not None
            or self.kv_transfer.needs_step()
            or bool(self._deferred_outputs)
            or bool(self.compiling)
        )

    def client_ids(self) -> list[bytes]:
        """The clients that hold live requests."""
        client_ids = list(self.scheduler.admission.num_live_by_client)
        if (pulls := self.kv_transfer.pulls) is not None:
            client_ids += [parked.client_id for parked in pulls.parked.values()]
        client_ids += [held.client_id for _, held in self.compiling or ()]
        return list(dict.fromkeys(client_ids))

    @property
    def num_unfinished_requests(self) -> int:
        """Live requests: the scheduler's, those parked for their pull (a decode engine), and
        those whose grammars compile."""
        pulls = self.kv_transfer.pulls
        num_parked = len(pulls.parked) if pulls is not None else 0
        num_compiling = len(self.compiling) if self.compiling is not None else 0
        return len(self.scheduler.requests) + num_parked + num_compiling

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    @property
    def num_steps_in_flight(self) -> int:
        """Steps sent to the ranks and not yet answered, as the scheduler records them."""
        return self.scheduler.num_steps_in_flight

    @property
    def max_model_len(self) -> int:
        """The longest sequence served: the configured bound, or the model's own."""
        return self.scheduler.max_model_len

    def step(self) -> dict[bytes, EngineCoreOutputs]:
        """Schedule, execute and update once; outputs keyed by client id.

        A step with no scheduled tokens still goes out while finished ids are pending, so that
        the workers drop those requests promptly; it then returns no outputs.
        """
        scheduler = self.scheduler
        self._admit_compiled()
        if self._pipeline is not None:
            return self._step_pipelined(self._pipeline)
        if not (
            scheduler.has_unfinished_requests()
            or scheduler.has_finished_requests()
            or self.kv_transfer.needs_step()
        ):
            return self._take_deferred_outputs({})
        start = perf_counter()
        scheduler_output = scheduler.schedule()
        scheduled = perf_counter()
        sent_output = self._with_transfer_orders(scheduler_output)
        model_runner_output = self.executor.execute_model(sent_output)
        executed = perf_counter()
        outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
        outputs = self._after_transfer_reply(model_runner_output, outputs)
        self.schedule_time_s += scheduled - start
        self.update_time_s += perf_counter() - executed
        if self._check_each_step:
            self.check_invariants()
        return outputs

    def _step_pipelined(self, pipeline: PipelinedExecutor) -> dict[bytes, EngineCoreOutputs]:
        """Asynchronous scheduling: two steps in flight, so the ranks start N+1 as soon as they
        finish N. Collect and apply N, then at once schedule and send N+2 behind N+1, before the
        server spends time on clients. Outputs are step N's."""
        if (error := self._send_error) is not None:
            self._send_error = None
            raise error
        steps_in_flight = self.scheduler.steps_in_flight
        if not steps_in_flight:  # the first step of a burst runs while the next one is planned
            self._submit_next(pipeline)
            return self._take_deferred_outputs({})
        if len(steps_in_flight) == 1:
            self._submit_next(pipeline)
        step = steps_in_flight.oldest()
        model_runner_output = pipeline.collect(step.step_id)
        collected = perf_counter()
        outputs = self.scheduler.update_from_output(step.scheduler_output, model_runner_output)
        # step N+1's constrained rows wait, on the ranks, for the grammars that step N's tokens
        # just advanced: their bitmask goes out first, before anything else
        send_error: Exception | None = None
        if (deferred := self.scheduler.take_grammar_bitmask()) is not None:
            try:
                pipeline.send_grammar_bitmask(*deferred)
            except Exception as exc:  # as a step that cannot be sent: N's outputs go out first
                send_error = exc
        outputs = self._after_transfer_reply(model_runner_output, outputs)
        self.update_time_s += perf_counter() - collected
        if self._check_each_step:
            self.check_invariants()
        if send_error is not None:  # no step goes out behind a bitmask the ranks never got
            self._send_error = send_error
            return outputs
        try:
            self._submit_next(pipeline)
        except Exception as exc:  # step N is applied: its outputs go out first
            self._send_error = exc
        return outputs

    def _submit_next(self, pipeline: PipelinedExecutor) -> None:
        """Schedule and send the next step, when there is anything to run or to tell the ranks."""
        scheduler = self.scheduler
        if (
            scheduler.has_unfinished_requests()
            or scheduler.has_finished_requests()
            or self.kv_transfer.needs_step()
        ):
            start = perf_counter()
            scheduler_output = scheduler.schedule()
            self.schedule_time_s += perf_counter() - start
            pipeline.submit(self._with_transfer_orders(scheduler_output))

    # -- disaggregated prefill and decode (DESIGN.md §12) ----------------------------------------

    def is_only_waiting(self) -> bool:
        """The one work left is hearing the ends of pulls the ranks run, or of grammars
        compiling: the server paces its loop rather than spinning (a compile that ends wakes it
        through `grammar_wake_fd`)."""
        scheduler = self.scheduler
        if (
            scheduler.has_unfinished_requests()
            or scheduler.has_finished_requests()
            or scheduler.num_steps_in_flight
            or self._deferred_outputs
        ):
            return False
        compiling = self.compiling
        if compiling is not None and compiling.has_ready():
            return False
        kv_transfer = self.kv_transfer
        return kv_transfer.is_pulling_only() or (bool(compiling) and not kv_transfer.needs_step())

    def _with_transfer_orders(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """The step as sent, with its P/D orders; the scheduler's record keeps it as built."""
        kv_transfer = self.kv_transfer
        if kv_transfer.pins is None and kv_transfer.pulls is None:
            return scheduler_output
        step = self.scheduler.steps_in_flight.newest()
        manager = self.scheduler.kv_cache_manager
        return kv_transfer.with_orders(
            scheduler_output,
            list(zip(step.requests, step.is_sampling, strict=True)),
            manager.get_block_ids,
        )

    def _after_transfer_reply(
        self, model_runner_output: ModelRunnerOutput, outputs: dict[bytes, EngineCoreOutputs]
    ) -> dict[bytes, EngineCoreOutputs]:
        """Queue the requests whose pulls settled, and give each prefill request that ended
        holding its blocks its handle."""
        for parked in self.kv_transfer.settle(model_runner_output):
            refusal = self.scheduler.add_request(parked.request, parked.client_id)
            if refusal is not None:
                self._defer(parked.client_id, refusal)
        return self._take_deferred_outputs(self.kv_transfer.with_handles(outputs))

    def _defer(self, client_id: bytes, batch: EngineCoreOutputs) -> None:
        self._deferred_outputs.setdefault(client_id, []).extend(batch.outputs)

    def _take_deferred_outputs(
        self, outputs: dict[bytes, EngineCoreOutputs]
    ) -> dict[bytes, EngineCoreOutputs]:
        if not self._deferred_outputs:
            return outputs
        for client_id, deferred in self._deferred_outputs.items():
            batch = outputs.get(client_id)
            outputs[client_id] = EngineCoreOutputs([*(batch.outputs if batch else []), *deferred])
        self._deferred_outputs = {}
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether any request is live, one parked for its pull included."""
        return self.num_unfinished_requests > 0

    def reset_prefix_cache(self) -> tuple[bool, str | None]:
        """Clear the prefix cache; (False, reason) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """The scheduler's snapshot; the requests whose grammars compile count as waiting (so
        vLLM counts those waiting for their grammar)."""
        stats = self.scheduler.make_stats()
        if not self.compiling:
            return stats
        num_waiting = stats.num_waiting_reqs + len(self.compiling)
        return msgspec.structs.replace(stats, num_waiting_reqs=num_waiting)

    def make_load(self) -> dict[str, int]:
        """The scheduler's load, with each request whose grammar compiles as a waiting prompt:
        a front end that routes by load sees the work it will be."""
        load = self.scheduler.make_load()
        for _, held in self.compiling or ():
            load["waiting_prefill_tokens"] += len(held.request.prompt_token_ids) // 4  # int32s
        return load

    def get_stats(self) -> dict[str, StatValue]:
        """`make_stats` flattened, for callers that read figures by key (`"num_steps"`)."""
        return stat_values(self.make_stats())

    def take_block_residency(self) -> BlockResidencyStats:
        """Sampled KV-cache block timings since the last call (empty without --kv-cache-metrics)."""
        return self.scheduler.kv_cache_manager.take_block_residency()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV-cache events since the last call, for the publisher (empty when events are off)."""
        return self.scheduler.kv_cache_manager.take_events()

    def requeue_for_new_workers(self) -> None:
        """The worker generation was lost: every request will recompute on the next one, and
        the scheduler forgets the steps in flight."""
        self._send_error = None
        if isinstance(self._pipeline, SerialPipeline):
            self._pipeline.forget()  # a WorkerGroup drops a retired generation's replies itself
        parked = self.kv_transfer.forget_all()  # the pinned and pulled pages were the old ranks'
        self.scheduler.requeue_for_new_workers()
        for one in parked:  # no pull completes: they compute their prompts on the new ranks
            refusal = self.scheduler.add_request(one.request, one.client_id)
            if refusal is not None:
                self._defer(one.client_id, refusal)

    @property
    def next_step_id(self) -> int:
        return self.scheduler.next_step_id

    def fail_all(self, error: str) -> dict[bytes, EngineCoreOutputs]:
        """Fail every unfinished request with `error`, e.g. when a worker died."""
        logger.error("failing %d requests: %s", len(self.scheduler.requests), error)
        self._send_error = None
        outputs = self.scheduler.fail_all(error)
        for req_id, _ in self.compiling or ():
            self._end_compiling(req_id, error, outputs, FinishReason.ERROR)
        if (pulls := self.kv_transfer.pulls) is not None:
            for one in pulls.fail_all():
                final = EngineCoreOutput(one.request.req_id, [], FinishReason.ERROR, 0, error)
                self._defer(one.client_id, EngineCoreOutputs([final]))
        return self._take_deferred_outputs(self.kv_transfer.with_handles(outputs))

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.kv_transfer.check_invariants()
        if self.compiling is not None:
            self.compiling.check_invariants()

    # -- what the server reads and builds; it never reaches the scheduler or the pool itself -----

    @property
    def max_num_encoder_tokens(self) -> int:
        """The longest encoder input a request may carry; 0 when the model has no encoder."""
        return self.scheduler.intake.max_num_encoder_tokens or 0

    def cached_block_counts(self) -> dict[str, int]:
        """The prefix cache as a KV-event subscriber should hold it: hex key -> copies cached."""
        return self.scheduler.kv_cache_manager.block_pool.cached_block_counts()

    def rejection(self, req_id: str, error: str) -> EngineCoreOutputs:
        """The one output of a request refused before admission (the engine is stopping, or its
        client reads no outputs), built as the scheduler builds its own refusals."""
        return rejection(req_id, error)
