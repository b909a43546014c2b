"""EngineServer: the engine's blocking step loop, which reads a bounded share of client input,
steps the EngineCore, streams outputs back, and replaces a lost worker generation (DESIGN.md §8).

Scheduling lives in EngineCore, the ZMQ executor in WorkerGroup, the client socket's rules in
ClientRouter, and the process main in engine_process.py. It never waits without a deadline.
"""

import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from engine_core.core import EngineCore
from engine_core.service.client_router import PROBE_INTERVAL_S, ClientRouter, MalformedFrame
from engine_core.service.recovery import WorkerRecovery
from engine_core.telemetry.kv_events import KVEventPublisher
from engine_core.telemetry.metrics import EngineMetrics
from engine_core.workers.handshake import HandshakeError
from engine_core.workers.rank_watch import WorkerGroupError
from engine_core.workers.worker_group import WorkerGroup
from kv_hashing.hash_params import hash_params
from protocol.client_messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    StatValue,
    UtilityCall,
    UtilityResult,
)
from protocol.config import EngineConfig
from protocol.stats import EngineStats, stat_values

logger = logging.getLogger(__name__)

METRICS_UPDATE_S = 0.5  # how often the gauges follow the scheduler's stats
KV_TRANSFER_EXPIRY_S = 0.1  # how often a prefill engine frees the transfers past their deadline
KV_PULL_POLL_MS = 2  # an otherwise idle decode engine's step rate while its ranks pull
IDLE_POLL_MS = 100  # how long an idle loop sleeps in poll; client input wakes it at once
BACKLOG_RETRY_MS = 5  # how often an idle loop retries a slow client's backlog
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class EngineServer:
    """The step loop and the client side of a started engine.

    Invariants: every client output goes to the identity that submitted the request; the loop
    steps only while the core has work, and otherwise sleeps in poll at most IDLE_POLL_MS; the
    stats line never reports more steps than were run; once a stop is requested no request is
    admitted, and the loop ends by `_stop_deadline` at the latest.
    """

    def __init__(
        self,
        config: EngineConfig,
        core: EngineCore,
        router: ClientRouter,
        workers: WorkerGroup,
        metrics: EngineMetrics | None = None,
        kv_events: KVEventPublisher | None = None,
        recovery: WorkerRecovery | None = None,
    ) -> None:
        """`recovery`: None is fail-stop (--max-worker-restarts 0)."""
        self.config = config
        self.recovery = recovery
        self.metrics = metrics
        self.kv_events = kv_events
        self.core = core
        self.router = router
        self.workers = workers
        self.is_stop_requested = False  # set by a signal handler; the loop then drains
        self._stop_deadline: float | None = None  # time.monotonic() by which draining ends
        self._poller = zmq.Poller()
        self._poller.register(router.sock, zmq.POLLIN)
        if (grammar_wake_fd := core.grammar_wake_fd) is not None:
            self._poller.register(grammar_wake_fd, zmq.POLLIN)
        self._worker_items: list[zmq.Socket | int] = []
        self._watch_workers()
        self._next_metrics_time = self._next_probe_time = self._next_expiry_time = 0.0
        self._last_stats_time = time.monotonic()
        self._next_stats_time = self._last_stats_time + config.log_stats_interval_s
        self._num_steps = self._num_steps_logged = 0
        self._num_tokens = self._num_tokens_logged = 0  # output tokens sent to clients
        self._peak_kv_cache_usage = 0.0  # the highest usage seen after any step

    def serve(self) -> int:
        """Run until a stop signal (drain, then exit 0) or a failure (every request failed, 1)."""
        try:
            while not self._is_done():
                try:
                    self._serve_once()
                except WorkerGroupError as exc:
                    if not self._recover(exc):
                        raise
        except (WorkerGroupError, HandshakeError) as exc:
            return self._fail(f"worker failure: {exc}")
        except Exception as exc:
            logger.exception("engine loop failed")
            return self._fail(f"engine failure: {type(exc).__name__}: {exc}")
        if self.core.has_unfinished_requests():
            timeout_s = self.config.shutdown_timeout_s
            error = f"the engine is shutting down: unfinished after {timeout_s} s of draining"
            self._send_outputs(self.core.fail_all(error))
        self.workers.shutdown("the engine is shutting down")
        self.core.close()
        self.router.flush()
        logger.info("engine stopped after %d steps", self._num_steps)
        return EXIT_OK

    def _is_done(self) -> bool:
        if not self.is_stop_requested:
            return False
        now = time.monotonic()
        if self._stop_deadline is None:
            self._stop_deadline = now + self.config.shutdown_timeout_s
            logger.info(
                "stopping: no new requests; draining %d for up to %.1f s",
                self.core.num_unfinished_requests,
                self.config.shutdown_timeout_s,
            )
        return not self.core.has_work() or now >= self._stop_deadline

    def _serve_once(self) -> None:
        has_work = self.core.has_work()
        backlog_ms = BACKLOG_RETRY_MS if self.router.backlogs else IDLE_POLL_MS
        # paced: empty steps hear the pulls end, and a compiled grammar wakes the poll
        if has_work and self.core.is_only_waiting():
            events = self._serve_clients(min(backlog_ms, KV_PULL_POLL_MS))
        else:
            events = self._serve_clients(0 if has_work else backlog_ms)
        if any(item in events for item in self._worker_items):
            self.workers.check_idle_events(self.core.num_steps_in_flight)
        if has_work or self.core.has_work():
            self._step()
        now = time.monotonic()
        if now >= self._next_expiry_time:
            self._next_expiry_time = now + KV_TRANSFER_EXPIRY_S
            self.core.kv_transfer.expire()  # their unpins make the next step go out
        if now >= self._next_probe_time:
            self._next_probe_time = now + PROBE_INTERVAL_S
            self.router.probe(self.core.client_ids())
        if now >= self._next_stats_time:
            self._log_stats()
        if self.metrics is not None and now >= self._next_metrics_time:
            self._next_metrics_time = now + METRICS_UPDATE_S
            self.metrics.on_stats(self.core.make_stats())
            self.metrics.on_block_residency(self.core.take_block_residency())
            kv_transfer = self.core.kv_transfer
            self.metrics.kv_transfer.on_stats(kv_transfer.stats(), kv_transfer.take_pull_seconds())

    def _serve_clients(self, timeout_ms: int) -> dict[zmq.Socket | int, int]:
        """The clients' half of one pass, which the handshake of a new worker generation runs
        alone: new input, slow clients' backlogs, and clients that left or stalled. Returns the
        poll's events, worker sockets included while a generation serves."""
        router = self.router
        events = dict(self._poller.poll(timeout_ms))
        if router.sock in events:
            self._handle_clients()
        if router.backlogs:
            router.flush()
        if router.left or router.stalled:
            self._abort_troubled_clients()
        return events

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.core.step()
        self._num_steps += 1
        self._num_tokens += sum(
            len(output.new_token_ids) for batch in outputs.values() for output in batch.outputs
        )
        self._send_outputs(outputs)
        self._peak_kv_cache_usage = max(self._peak_kv_cache_usage, self.core.kv_cache_usage)
        if self.config.check_invariants:
            self.check_invariants()
        self._publish_kv_events()
        if self.metrics is not None:
            self.metrics.step_time.observe(time.perf_counter() - start)
            self.metrics.on_outputs(outputs)

    # -- rank recovery -------------------------------------------------------------------------

    def _recover(self, error: WorkerGroupError) -> bool:
        """Replace the lost generation and resume; False when the engine must fail-stop."""
        if self.recovery is None or not self.recovery.can_recover(error):
            return False
        for item in self._worker_items:  # the retirement closes the old ranks' pidfds
            self._poller.unregister(item)
        self._worker_items = []
        self.recovery.recover(self.core, self.workers, error, self._serve_clients_while_waiting)
        self._publish_kv_events()  # AllBlocksCleared: the new ranks' caches hold nothing
        self._watch_workers()
        self.core.kv_transfer.set_endpoints(self.workers.kv_transfer_endpoints)
        return True

    def _serve_clients_while_waiting(self) -> None:
        """While a new generation joins: take requests and answer calls, so that clients see
        latency only. The handshake's own poll does the waiting, so this one never blocks; the
        poller holds the client socket alone, the old ranks' sockets being unregistered. A stop
        signal ends the wait, since nothing can drain without ranks."""
        if self.is_stop_requested:
            raise HandshakeError("the engine was stopped while waiting for new worker ranks")
        self._serve_clients(0)

    def _watch_workers(self) -> None:
        self._worker_items = self.workers.pollables()
        for item in self._worker_items:
            self._poller.register(item, zmq.POLLIN)

    def _log_stats(self) -> None:
        """One INFO line every log_stats_interval_s, only while the engine is doing something."""
        now = time.monotonic()
        interval_s, self._last_stats_time = now - self._last_stats_time, now
        self._next_stats_time = now + self.config.log_stats_interval_s
        if self._num_steps == self._num_steps_logged:
            return
        steps_per_s = (self._num_steps - self._num_steps_logged) / interval_s
        tokens_per_s = (self._num_tokens - self._num_tokens_logged) / interval_s
        self._num_steps_logged, self._num_tokens_logged = self._num_steps, self._num_tokens
        stats = self.core.make_stats()
        prefix_cache = stats.prefix_cache
        hit_rate = prefix_cache.hits / prefix_cache.queries if prefix_cache.queries else 0.0
        logger.info(
            "%.1f steps/s, %.1f output tokens/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%",
            steps_per_s,
            tokens_per_s,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
        )

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.core.take_kv_events())

    def _fail(self, error: str) -> int:
        if self.metrics is not None:
            self.metrics.is_healthy = False
        logger.error("%s; failing every request and stopping the workers", error)
        self._send_outputs(self.core.fail_all(error))
        self.workers.shutdown(error, is_failure=True)
        self.core.close()
        self.router.flush()
        return EXIT_FAILED

    # -- clients -------------------------------------------------------------------------------

    def _handle_clients(self) -> None:
        router = self.router
        for identity, message in router.receive():
            match message:
                case EngineCoreRequest():
                    self._add_request(identity, message)
                case AbortRequests():
                    self._send_outputs(self.core.abort_requests(message.req_ids, identity))
                case UtilityCall():
                    router.send(identity, self._call_utility(message))
                case MalformedFrame():
                    req_id, call_id = router.frame_ids(message.frame)
                    if req_id is not None and self.core.is_live(identity, req_id):
                        req_id = None  # never fail a live request for another frame's fault
                    router.reject_malformed(identity, message, req_id, call_id)

    def _add_request(self, identity: bytes, request: EngineCoreRequest) -> None:
        if self.is_stop_requested:
            self._reject(identity, request.req_id, "the engine is shutting down: retry elsewhere")
        elif self.router.is_stalled(identity):
            self._reject(
                identity,
                request.req_id,
                "the client reads no outputs: its backlog is over max_client_backlog_bytes="
                f"{self.config.max_client_backlog_bytes}",
            )
        else:
            rejection = self.core.add_request(request, identity)
            if rejection is not None:
                self.router.send(identity, rejection)
            elif self.metrics is not None:
                self.metrics.on_request(identity, request.req_id)

    def _reject(self, identity: bytes, req_id: str, reason: str) -> None:
        logger.warning("rejected request %r: %s", req_id, reason)
        self.router.send(identity, self.core.rejection(req_id, reason))

    def _abort_troubled_clients(self) -> None:
        """Free the blocks of clients that left, and end the requests of those that stalled."""
        for identity in self.router.take_left():
            aborted = self.core.abort_client(identity, "the client left")  # nobody to tell
            self.router.forget(identity)
            if aborted:
                num_aborted = len(aborted[identity].outputs)
                logger.info("aborted %d requests of a client that left", num_aborted)
        for identity in self.router.take_stalled():
            backlog_bytes = self.config.max_client_backlog_bytes
            error = (
                "aborted: the client read too slowly, and more than max_client_backlog_bytes="
                f"{backlog_bytes} of outputs waited for it"
            )
            logger.warning("client %s stalled: %s", identity.hex(), error)
            self._send_outputs(self.core.abort_client(identity, error))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        methods: dict[str, Callable[[], tuple[bool, StatValue | dict, str | None]]] = {
            "reset_prefix_cache": self._reset_prefix_cache,
            "get_stats": lambda: (True, self._stats(), None),
            "check_health": lambda: (True, True, None),
            "get_model_info": lambda: (True, self._model_info(), None),
            "get_cached_block_hashes": lambda: (True, self.core.cached_block_counts(), None),
            "get_routing_info": lambda: (True, self._routing_info(), None),
            "get_load": lambda: (True, self.core.make_load(), None),
        }
        method = methods.get(call.method)
        if call.method == "release_kv_transfer":
            return self._release_kv_transfer(call)
        if method is None:
            names = sorted([*methods, "release_kv_transfer"])
            error = f"unknown utility method {call.method!r}: expected one of {names}"
            return UtilityResult(call.call_id, False, error=error)
        if call.args:
            error = f"{call.method} takes no arguments, got {len(call.args)}"
            return UtilityResult(call.call_id, False, error=error)
        ok, value, error = method()
        return UtilityResult(call.call_id, ok, value, error)

    def _release_kv_transfer(self, call: UtilityCall) -> UtilityResult:
        """`release_kv_transfer(transfer_id, secret)`: a decode engine answered for the handle,
        so its blocks may go to the prefix cache now rather than at the deadline."""
        match call.args:
            case [int() as transfer_id, str() as secret] if not isinstance(transfer_id, bool):
                ok, error = self.core.kv_transfer.release(transfer_id, secret)
                return UtilityResult(call.call_id, ok, ok, error)
        error = f"release_kv_transfer takes (transfer_id: int, secret: str), got {call.args!r}"
        return UtilityResult(call.call_id, False, error=error)

    def _reset_prefix_cache(self) -> tuple[bool, StatValue, str | None]:
        ok, reason = self.core.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared
        logger.info("reset_prefix_cache: %s", "done" if ok else reason)
        return ok, ok, reason

    def _model_info(self) -> dict[str, StatValue]:
        """What a front end checks a request against before sending it: a prompt past
        max_model_len, or a frame past the client socket's limit (which drops the connection)."""
        return {
            "model": self.core.model_info.name,
            "max_model_len": self.core.max_model_len,
            "vocab_size": self.core.model_info.vocab_size,
            "max_request_frame_bytes": self.router.sock.getsockopt(zmq.MAXMSGSIZE),
        }

    def _routing_info(self) -> dict[str, StatValue]:
        """What a KV-aware front end needs to route here: the hash parameters (it refuses to
        route over engines that disagree) and where this engine publishes its KV events (the
        endpoints as bound: the front end puts the engine's host in for a wildcard)."""
        groups = self.core.kv_cache_config.kv_cache_groups
        params = hash_params(self.config.cache, [group.spec.block_size for group in groups])
        events = self.config.kv_events
        is_publishing = events.enable_kv_cache_events
        layout = msgspec.structs.asdict(self.core.kv_transfer_layout)
        return msgspec.structs.asdict(params) | {
            "kv_events_endpoint": events.endpoint if is_publishing else None,
            "kv_events_replay_endpoint": events.replay_endpoint if is_publishing else None,
            "kv_events_topic": events.topic,
            # P/D (DESIGN.md §12): the role, and the layout a prefill/decode pair must share
            "kv_role": self.config.kv_role,
            **{f"kv_layout_{name}": value for name, value in layout.items()},
        }

    def _stats(self) -> dict[str, StatValue]:
        stats = EngineStats(
            scheduler=self.core.make_stats(),
            tp_size=self.config.tp_size,
            num_engine_steps=self._num_steps,
            num_output_tokens=self._num_tokens,
            peak_kv_cache_usage=self._peak_kv_cache_usage,
            client_backlog_bytes=self.router.backlog_bytes,
            step_schedule_s=self.core.schedule_time_s,
            step_encode_s=self.workers.encode_time_s,
            step_transport_s=self.workers.transport_time_s,
            step_update_s=self.core.update_time_s,
            num_worker_restarts=self.recovery.num_restarts if self.recovery is not None else 0,
            rank_forward_s=self.workers.rank_forward_time_s,
        )
        return stat_values(stats) | self.core.kv_transfer.stats()

    def check_invariants(self) -> None:
        """The loop's own counters and the invariants of what it drives; the core walks its own
        after each step when --check-invariants is set."""
        assert 0 <= self._num_steps_logged <= self._num_steps, (
            f"logged step {self._num_steps_logged} is ahead of step {self._num_steps}"
        )
        self.workers.check_invariants()
        self.router.check_invariants()
        if self.recovery is not None:
            self.recovery.check_invariants()
        if self.metrics is not None:
            self.metrics.check_invariants()

    def _send_outputs(self, outputs: dict[bytes, EngineCoreOutputs]) -> None:
        send = self.router.send
        for identity, client_outputs in outputs.items():
            send(identity, client_outputs)
