"""The engine's process main: bind the sockets, run the startup handshake of DESIGN.md §6, then
serve until a stop signal or a failure. Exit codes: 0 clean, 1 a failure, 2 a usage error.

It owns the order of startup and teardown only; the step loop is EngineServer's.
"""

import gc
import logging
import signal
from collections.abc import Callable

import zmq

from engine_core.net.address import AddressInUseError
from engine_core.net.curve import start_zap_guard
from engine_core.net.curve_refusals import REFUSAL_EVENTS, RefusalWatch
from engine_core.net.endpoints import Endpoints, check_free
from engine_core.service.recovery import WorkerRecovery
from engine_core.service.server import EXIT_FAILED, EXIT_OK, EXIT_USAGE, EngineServer
from engine_core.service.startup import (
    CLIENT_LINGER_MS,
    StartupFlagError,
    bind_clients,
    serve_metrics,
    start_engine_core,
    start_kv_event_publisher,
)
from engine_core.telemetry.kv_events import KVEventPublisher
from engine_core.telemetry.metrics import EngineMetrics
from engine_core.workers.handshake import HandshakeError
from engine_core.workers.rank_watch import WorkerGroupError
from engine_core.workers.worker_group import WorkerGroup
from protocol.config import EngineConfig

logger = logging.getLogger(__name__)


def run(config: EngineConfig) -> int:
    """The engine's process main: bind, handshake, serve; 0 on a clean stop, 1 on a failure, 2
    when an address is taken or, without CURVE keys, reachable from other hosts."""
    ctx = zmq.Context()
    endpoints = Endpoints(config.curve)
    parts: list[Callable[[], None]] = []  # closers, run in reverse order at exit
    try:
        return _bind_and_serve(config, ctx, endpoints, parts)
    except AddressInUseError as exc:
        logger.error("%s", exc)
        return EXIT_USAGE
    finally:
        for close in reversed(parts):
            close()
        ctx.term()
        endpoints.remove_files()


def _bind_and_serve(
    config: EngineConfig, ctx: zmq.Context, endpoints: Endpoints, parts: list[Callable[[], None]]
) -> int:
    guard = start_zap_guard(ctx, config)  # before any bind, or CURVE sockets admit every key
    parts.extend([guard.stop] if guard is not None else [])
    # The client socket binds once the model's max_model_len is known; check it is free first.
    check_free(config.client_address, "--client-address")
    workers = WorkerGroup(
        ctx,
        config.worker_address,
        config.tp_size,
        config.step_timeout_s,
        config.heartbeat_interval_s,
        config.heartbeat_timeout_s,
        endpoints,
        is_shm_ring_enabled=config.enable_shm_ring,
    )
    parts.append(workers.close)
    metrics = EngineMetrics() if config.metrics_port is not None else None
    if metrics is not None:
        http = serve_metrics(metrics, config)
        parts.append(http.close)
        parts.append(lambda: setattr(metrics, "is_healthy", False))
    kv_events = None
    if config.kv_events.enable_kv_cache_events:
        kv_events = start_kv_event_publisher(ctx, config, endpoints)
        parts.append(kv_events.close)
    logger.info(
        "engine up: clients at %s, %d worker rank(s) at %s",
        config.client_address,
        config.tp_size,
        config.worker_address,
    )
    return _start_and_serve(config, ctx, endpoints, parts, workers, metrics, kv_events)


def _start_and_serve(
    config: EngineConfig,
    ctx: zmq.Context,
    endpoints: Endpoints,
    parts: list[Callable[[], None]],
    workers: WorkerGroup,
    metrics: EngineMetrics | None,
    kv_events: KVEventPublisher | None,
) -> int:
    server: EngineServer | None = None
    is_starting = True  # False once startup failed: its teardown then runs to the end

    def request_stop(signum: int, frame: object) -> None:
        logger.info("signal %d: stopping", signum)
        if server is not None:
            server.is_stop_requested = True
        elif is_starting:  # the handshake blocks in waits of its own: leave them
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        core = start_engine_core(config, workers)
        router = bind_clients(
            config, ctx, endpoints, core.max_model_len, core.max_num_encoder_tokens
        )
    except (HandshakeError, WorkerGroupError, AddressInUseError) as exc:
        is_starting = False  # a launcher's SIGTERM, seeing the ranks leave, must not cut this short
        logger.error("startup failed: %s", exc)
        workers.shutdown(f"engine startup failed: {exc}", is_failure=True)
        is_usage = isinstance(exc, (AddressInUseError, StartupFlagError))
        return EXIT_USAGE if is_usage else EXIT_FAILED
    except KeyboardInterrupt:
        is_starting = False
        workers.shutdown("the engine was stopped during startup")
        return EXIT_OK
    parts.append(lambda: router.sock.close(linger=CLIENT_LINGER_MS))
    if config.curve is not None:  # log the peers CURVE refuses before ZAP hears of them
        monitors = [(router.sock.get_monitor_socket(REFUSAL_EVENTS), "--client-address")]
        monitors += kv_events.refusal_monitors if kv_events is not None else []
        parts.append(RefusalWatch(monitors).close)
    recovery = None
    if config.max_worker_restarts:
        recovery = WorkerRecovery(config, core.kv_cache_config, core.model_info, metrics)
    server = EngineServer(config, core, router, workers, metrics, kv_events, recovery)
    # The pool's blocks live as long as the engine: keep full collections from walking them.
    gc.collect()
    gc.freeze()
    if metrics is not None:
        metrics.is_healthy = True
    logger.info("serving clients at %s", config.client_address)
    return server.serve()
