"""The engine process: binds the client and worker sockets, runs the handshake of DESIGN.md §6, then
a blocking step loop that reads client input, steps the EngineCore and streams outputs back.

It owns sockets and the process lifecycle; scheduling lives in EngineCore, the ZMQ executor in
WorkerGroup. It never waits without a deadline, and a failed rank takes the engine down (exit 1).
"""

import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec
import zmq

from engine_core.core import EngineCore
from engine_core.handshake import HandshakeError
from engine_core.kv_cache.spec import bytes_per_block, plan_kv_cache
from engine_core.kv_events import KVEventPublisher
from engine_core.metrics import EngineMetrics, MetricsServer
from engine_core.worker_group import WorkerGroup, WorkerGroupError
from protocol.client_messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    StatValue,
    UtilityCall,
    UtilityResult,
)
from protocol.codec import client_to_engine_decoder, make_encoder
from protocol.config import EngineConfig
from protocol.errors import ProtocolError

logger = logging.getLogger(__name__)

METRICS_UPDATE_S = 0.5  # how often the gauges follow the scheduler's stats
IDLE_POLL_MS = 100  # how long an idle loop sleeps in poll; client input wakes it at once
CLIENT_LINGER_MS = 2000  # time given to final outputs to reach their clients at exit
IPC_PREFIX = "ipc://"
MALFORMED_REQ_ID = "<malformed>"  # names a rejected frame that carried no readable req_id
EXIT_OK, EXIT_FAILED = 0, 1


def start_engine_core(config: EngineConfig, workers: WorkerGroup) -> EngineCore:
    """DESIGN.md §6: every rank says hello, they agree on num_blocks, and every rank is ready."""
    deadline = time.monotonic() + config.handshake_timeout_s
    hellos = workers.wait_for_hellos(deadline)
    model_info = hellos[0].model_info
    groups = model_info.kv_cache_groups
    for group in groups:
        if group.spec.block_size != config.cache.block_size:
            raise HandshakeError(
                f"the workers use block_size={group.spec.block_size}, "
                f"expected the engine's {config.cache.block_size}"
            )
    block_bytes = bytes_per_block(groups, config.tp_size)
    available = [hellos[rank].num_blocks_available * block_bytes for rank in range(config.tp_size)]
    max_model_len = min(
        config.scheduler.max_model_len or model_info.max_model_len, model_info.max_model_len
    )
    try:
        plan = plan_kv_cache(
            groups, available, config.tp_size, max_model_len, config.cache.num_gpu_blocks_override
        )
    except ValueError as exc:
        raise HandshakeError(str(exc)) from None
    logger.info(
        "ranks hold %s blocks; using %d. %s",
        plan.num_blocks_per_rank,
        plan.config.num_blocks,
        plan.summary,
    )
    workers.send_kv_cache_config(plan.config)
    workers.wait_for_ready(plan.config.num_blocks, deadline)
    logger.info("all %d ranks ready: serving %s", config.tp_size, model_info.name)
    return EngineCore(config, plan.config, model_info, workers)


class EngineServer:
    """The step loop and the client socket of a started engine.

    Invariants: every client output goes to the identity that submitted the request; the loop
    steps only while the core has work, and otherwise sleeps in poll at most IDLE_POLL_MS; the
    stats line never reports more steps than were run.
    """

    def __init__(
        self,
        config: EngineConfig,
        core: EngineCore,
        clients: zmq.Socket,
        workers: WorkerGroup,
        metrics: EngineMetrics | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.kv_events = kv_events
        self.core = core
        self.clients = clients
        self.workers = workers
        self.is_stop_requested = False
        self._encoder = make_encoder()
        self._decoder = client_to_engine_decoder()
        self._poller = zmq.Poller()
        self._poller.register(clients, zmq.POLLIN)
        self._worker_items = {workers.sock, workers.monitor, *workers.sentinels}
        for item in self._worker_items:
            self._poller.register(item, zmq.POLLIN)
        self._next_metrics_time = 0.0
        self._last_stats_time = time.monotonic()
        self._next_stats_time = self._last_stats_time + config.log_stats_interval_s
        self._num_steps = self._num_steps_logged = 0
        self._num_tokens = self._num_tokens_logged = 0  # output tokens sent to clients
        self._peak_kv_cache_usage = 0.0  # the highest usage seen after any step

    def serve(self) -> int:
        """Run until a stop signal (exit 0) or a failure (exit 1, every request failed first)."""
        try:
            while not self.is_stop_requested:
                self._serve_once()
        except WorkerGroupError as exc:
            return self._fail(f"worker failure: {exc}")
        except Exception as exc:
            logger.exception("engine loop failed")
            return self._fail(f"engine failure: {type(exc).__name__}: {exc}")
        if self.core.has_unfinished_requests():
            self._send_outputs(self.core.fail_all("the engine is shutting down"))
        self.workers.shutdown("the engine is shutting down")
        logger.info("engine stopped after %d steps", self._num_steps)
        return EXIT_OK

    def _serve_once(self) -> None:
        has_work = self._has_work()
        events = dict(self._poller.poll(0 if has_work else IDLE_POLL_MS))
        if self.clients in events:
            self._drain_clients()
        if any(item in events for item in self._worker_items):
            self.workers.check_idle_events()
        if has_work or self._has_work():
            start = time.perf_counter()
            outputs = self.core.step()
            self._num_steps += 1
            self._num_tokens += sum(
                len(output.new_token_ids) for batch in outputs.values() for output in batch.outputs
            )
            self._send_outputs(outputs)
            usage = self.core.scheduler.kv_cache_manager.usage
            self._peak_kv_cache_usage = max(self._peak_kv_cache_usage, usage)
            if self.config.check_invariants:
                self.check_invariants()
            self._publish_kv_events()
            if self.metrics is not None:
                self.metrics.step_time.observe(time.perf_counter() - start)
                self.metrics.on_outputs(outputs)
        now = time.monotonic()
        if now >= self._next_stats_time:
            self._log_stats()
        if self.metrics is not None and now >= self._next_metrics_time:
            self._next_metrics_time = now + METRICS_UPDATE_S
            self.metrics.on_stats(self.core.get_stats())

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
        stats = self.core.get_stats()
        queries = stats.get("prefix_cache_queries", 0) or 0
        hit_rate = (stats.get("prefix_cache_hits", 0) or 0) / queries if queries else 0.0
        logger.info(
            "%.1f steps/s, %.1f output tokens/s, running %s, waiting %s, KV usage %.1f%%, "
            "prefix hit rate %.1f%%",
            steps_per_s,
            tokens_per_s,
            stats.get("num_running_reqs"),
            stats.get("num_waiting_reqs"),
            100 * float(stats.get("kv_cache_usage", 0.0)),
            100 * hit_rate,
        )

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.core.take_kv_events())

    def _has_work(self) -> bool:
        core = self.core
        return core.has_unfinished_requests() or core.scheduler.has_finished_requests()

    def _fail(self, error: str) -> int:
        if self.metrics is not None:
            self.metrics.is_healthy = False
        logger.error("%s; failing every request and stopping the workers", error)
        self._send_outputs(self.core.fail_all(error))
        self.workers.shutdown(error, is_failure=True)
        return EXIT_FAILED

    # -- clients -------------------------------------------------------------------------------

    def _drain_clients(self) -> None:
        while True:
            try:
                frames = self.clients.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject_malformed(frames[0], b"", f"expected 1 frame, got {len(frames) - 1}")
                continue
            self._handle_client(frames[0], frames[1])

    def _handle_client(self, identity: bytes, frame: bytes) -> None:
        try:
            message = self._decoder.decode(frame)
        except ProtocolError as exc:
            self._reject_malformed(identity, frame, str(exc))
            return
        match message:
            case EngineCoreRequest():
                rejection = self.core.add_request(message, identity)
                if rejection is not None:
                    self._send(identity, rejection)
                elif self.metrics is not None:
                    self.metrics.on_request(message.req_id)
            case AbortRequests():
                self._send_outputs(self.core.abort_requests(message.req_ids))
            case UtilityCall():
                self._send(identity, self._call_utility(message))

    def _reject_malformed(self, identity: bytes, frame: bytes, reason: str) -> None:
        """Answer a frame that failed to decode, naming its req_id or call_id when readable."""
        logger.warning("rejected a malformed frame: %s", reason)
        try:
            fields = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, ValueError):
            fields = None
        if isinstance(fields, dict) and isinstance(fields.get("call_id"), int):
            self._send(identity, UtilityResult(fields["call_id"], False, error=reason))
            return
        req_id = fields.get("req_id") if isinstance(fields, dict) else None
        if not isinstance(req_id, str) or not req_id or req_id in self.core.scheduler.requests:
            req_id = MALFORMED_REQ_ID  # never fail a live request for another frame's fault
        output = EngineCoreOutput(req_id, [], FinishReason.ERROR, error=reason)
        self._send(identity, EngineCoreOutputs([output], timestamp=time.time()))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        methods: dict[str, Callable[[], tuple[bool, StatValue | dict, str | None]]] = {
            "reset_prefix_cache": self._reset_prefix_cache,
            "get_stats": lambda: (True, self._stats(), None),
            "check_health": lambda: (True, True, None),
        }
        method = methods.get(call.method)
        if method is None:
            error = f"unknown utility method {call.method!r}: expected one of {sorted(methods)}"
            return UtilityResult(call.call_id, False, error=error)
        if call.args:
            error = f"{call.method} takes no arguments, got {len(call.args)}"
            return UtilityResult(call.call_id, False, error=error)
        ok, value, error = method()
        return UtilityResult(call.call_id, ok, value, error)

    def _reset_prefix_cache(self) -> tuple[bool, StatValue, str | None]:
        ok, reason = self.core.reset_prefix_cache()
        self._publish_kv_events()  # AllBlocksCleared
        logger.info("reset_prefix_cache: %s", "done" if ok else reason)
        return ok, ok, reason

    def _stats(self) -> dict[str, StatValue]:
        stats: dict[str, StatValue] = dict(self.core.get_stats())
        stats["tp_size"] = self.config.tp_size
        stats["num_engine_steps"] = self._num_steps
        stats["num_output_tokens"] = self._num_tokens
        stats["peak_kv_cache_usage"] = self._peak_kv_cache_usage
        return stats

    def check_invariants(self) -> None:
        """The loop's own counters and the invariants of what it drives; the core walks its own
        after each step when --check-invariants is set."""
        assert 0 <= self._num_steps_logged <= self._num_steps, (
            f"logged step {self._num_steps_logged} is ahead of step {self._num_steps}"
        )
        self.workers.check_invariants()
        if self.metrics is not None:
            self.metrics.check_invariants()

    def _send_outputs(self, outputs: dict[bytes, EngineCoreOutputs]) -> None:
        for identity, client_outputs in outputs.items():
            self._send(identity, client_outputs)

    def _send(self, identity: bytes, message: EngineCoreOutputs | UtilityResult) -> None:
        try:
            self.clients.send_multipart((identity, self._encoder.encode(message)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("dropped an output to a client that left: %s", exc)


def run(config: EngineConfig) -> int:
    """The engine's process main: bind, handshake, serve; 0 on a clean stop, 1 on a failure."""
    ctx = zmq.Context()
    clients = ctx.socket(zmq.ROUTER)
    clients.setsockopt(zmq.LINGER, CLIENT_LINGER_MS)
    clients.bind(config.client_address)
    workers = WorkerGroup(
        ctx,
        config.worker_address,
        config.tp_size,
        config.step_timeout_s,
        config.heartbeat_interval_s,
        config.heartbeat_timeout_s,
    )
    logger.info(
        "engine up: clients at %s, %d worker rank(s) at %s",
        config.client_address,
        config.tp_size,
        config.worker_address,
    )
    metrics = EngineMetrics() if config.metrics_port is not None else None
    http = MetricsServer(metrics, config.metrics_port) if metrics is not None else None
    kv_events = None
    if config.kv_events.enable_kv_cache_events:
        kv_events = KVEventPublisher(ctx, config.kv_events)
    try:
        return _start_and_serve(config, clients, workers, metrics, kv_events)
    finally:
        if kv_events is not None:
            kv_events.close()
        if metrics is not None:
            metrics.is_healthy = False
        if http is not None:
            http.close()
        workers.close()
        clients.close()
        ctx.term()
        remove_ipc_files(_bound_addresses(config))


def _bound_addresses(config: EngineConfig) -> list[str]:
    addresses = [config.client_address, config.worker_address]
    if config.kv_events.enable_kv_cache_events:
        addresses.append(config.kv_events.endpoint)
        if config.kv_events.replay_endpoint is not None:
            addresses.append(config.kv_events.replay_endpoint)
    return addresses


def remove_ipc_files(addresses: list[str]) -> None:
    """libzmq leaves the file of a bound ipc:// socket behind; the engine removes its own."""
    for address in addresses:
        path = address.removeprefix(IPC_PREFIX)
        if address.startswith(IPC_PREFIX) and not path.startswith("@"):  # @: abstract, no file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _start_and_serve(
    config: EngineConfig,
    clients: zmq.Socket,
    workers: WorkerGroup,
    metrics: EngineMetrics | None,
    kv_events: KVEventPublisher | None,
) -> int:
    server: EngineServer | None = None

    def request_stop(signum: int, frame: object) -> None:
        logger.info("signal %d: stopping", signum)
        if server is None:
            raise KeyboardInterrupt
        server.is_stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        core = start_engine_core(config, workers)
    except (HandshakeError, WorkerGroupError) as exc:
        logger.error("startup failed: %s", exc)
        workers.shutdown(f"engine startup failed: {exc}", is_failure=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        workers.shutdown("the engine was stopped during startup")
        return EXIT_OK
    server = EngineServer(config, core, clients, workers, metrics, kv_events)
    # The pool's blocks live as long as the engine: keep full collections from walking them.
    gc.collect()
    gc.freeze()
    if metrics is not None:
        metrics.is_healthy = True
    return server.serve()
