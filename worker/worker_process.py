"""The worker's process main: connect the DEALER to the engine, run a Worker, and on any failure
tell the engine (WorkerFailed) before exiting 1."""

import logging

import zmq

from protocol.config import WorkerConfig
from protocol.worker_messages import WorkerFailed
from worker.distributed import destroy_tp_group
from worker.worker import (
    EXIT_FAILED,
    EXIT_OK,
    FAILED_LINGER_MS,
    HEARTBEAT_TTL_FACTOR,
    EngineGoneError,
    StopSignalGraceError,
    Worker,
)

logger = logging.getLogger(__name__)


def _connect(ctx: zmq.Context, config: WorkerConfig) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = int(config.engine_timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, min(1000, timeout_ms))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms * HEARTBEAT_TTL_FACTOR)
    if config.curve is not None:  # a CURVE client: the worker keypair, the engine's public key
        sock.setsockopt(zmq.CURVE_SERVERKEY, config.curve.server_public_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, config.curve.public_key.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, config.curve.secret_key.encode())
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(config.engine_address)
    return sock, monitor


def run(config: WorkerConfig) -> int:
    """The worker's process main: 0 after a clean Shutdown, 1 on any failure."""
    ctx = zmq.Context()
    sock, monitor = _connect(ctx, config)
    worker = Worker(config, sock, monitor)
    try:
        return worker.run()
    except EngineGoneError as exc:
        logger.error("%s; exiting", exc)
        return EXIT_FAILED
    except StopSignalGraceError as exc:
        logger.warning("%s; exiting as asked", exc)
        return EXIT_OK
    except Exception as exc:
        logger.exception("rank %d failed", config.rank)
        error = f"{type(exc).__name__}: {exc}"
        step_id = worker.failing_step_id()
        failed = WorkerFailed(config.rank, step_id or None, error, worker.generation)
        try:
            sock.send(worker.encoder.encode(failed), zmq.NOBLOCK)
            sock.setsockopt(zmq.LINGER, FAILED_LINGER_MS)  # let WorkerFailed reach the engine
        except zmq.ZMQError as send_error:
            logger.error("could not tell the engine: %s", send_error)
        return EXIT_FAILED
    finally:
        worker.close_stream()
        worker.close_tiers()
        worker.close_kv_transfer()
        worker.close_ring()
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
        ctx.term()
        if worker.tp_group is not None:
            destroy_tp_group(worker.tp_group)
