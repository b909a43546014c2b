"""Startup of an engine: binding its sockets (a busy address is one clear error), the handshake of
DESIGN.md §6 (every rank says hello, they agree on num_blocks, every rank is ready), and only then
the EngineCore and the client socket, sized to the model's max_model_len.
"""

import logging
import time

import zmq

from engine_core.core import EngineCore
from engine_core.net.address import AddressInUseError
from engine_core.net.endpoints import Endpoints, check_free, prepare_ipc_folder
from engine_core.service.client_router import ClientRouter
from engine_core.service.plan import FlagValueError, plan_engine
from engine_core.telemetry.kv_events import KVEventPublisher
from engine_core.telemetry.metrics import EngineMetrics, MetricsServer
from engine_core.workers.handshake import HandshakeError
from engine_core.workers.worker_group import WorkerGroup
from protocol.client_messages import REQUEST_FRAME_HEADROOM_BYTES
from protocol.config import EngineConfig

logger = logging.getLogger(__name__)

CLIENT_LINGER_MS = 2000  # time given to final outputs to reach their clients at exit


class StartupFlagError(HandshakeError):
    """The handshake found a flag's value that cannot work with the loaded model: exit 2."""


def start_engine_core(config: EngineConfig, workers: WorkerGroup) -> EngineCore:
    """DESIGN.md §6: every rank says hello, they agree on num_blocks, and every rank is ready."""
    deadline = time.monotonic() + config.handshake_timeout_s
    hellos = workers.wait_for_hellos(deadline)
    model_info = hellos[0].model_info
    num_blocks_per_rank = [hellos[rank].num_blocks_available for rank in range(config.tp_size)]
    try:
        plan = plan_engine(config, model_info, num_blocks_per_rank)
    except FlagValueError as exc:
        raise StartupFlagError(str(exc)) from None
    except ValueError as exc:
        raise HandshakeError(str(exc)) from None
    kv_cache_config = plan.kv_cache_config
    logger.info(
        "ranks hold %s blocks; using %d. %s",
        plan.num_blocks_per_rank,
        kv_cache_config.num_blocks,
        plan.summary,
    )
    workers.send_kv_cache_config(kv_cache_config)
    workers.wait_for_ready(kv_cache_config.num_blocks, deadline)
    logger.info("all %d ranks ready: serving %s", config.tp_size, model_info.name)
    core = EngineCore(config, kv_cache_config, model_info, workers, plan.limits)
    core.kv_transfer.set_endpoints(workers.kv_transfer_endpoints)
    if config.kv_role != "both":
        logger.info(
            "kv role %s; ranks serve transfers at %s", config.kv_role, workers.kv_transfer_endpoints
        )
    return core


def serve_metrics(metrics: EngineMetrics, config: EngineConfig) -> MetricsServer:
    """HTTP /metrics and /health on --metrics-host (loopback unless the operator opens it)."""
    host, port = config.metrics_host, config.metrics_port
    assert port is not None, "serve_metrics without a --metrics-port"
    try:
        return MetricsServer(metrics, port, host)
    except OSError as exc:
        raise AddressInUseError(
            f"cannot serve --metrics-host {host} --metrics-port {port}: {exc.strerror}"
        ) from None


def start_kv_event_publisher(
    ctx: zmq.Context, config: EngineConfig, endpoints: Endpoints
) -> KVEventPublisher:
    addresses = [config.kv_events.endpoint, config.kv_events.replay_endpoint]
    for address in filter(None, addresses):
        check_free(address, "--kv-events-config")
        prepare_ipc_folder(address)
    try:
        publisher = KVEventPublisher(ctx, config.kv_events, endpoints.curve)
    except zmq.ZMQError as exc:
        raise AddressInUseError(f"cannot bind --kv-events-config: {exc.strerror}") from None
    for address in filter(None, addresses):
        endpoints.adopt(address)
    return publisher


def bind_clients(
    config: EngineConfig,
    ctx: zmq.Context,
    endpoints: Endpoints,
    max_model_len: int,
    max_num_encoder_tokens: int = 0,
) -> ClientRouter:
    """The client socket, refusing frames longer than a max_model_len prompt, the longest
    encoder input (0 without an encoder) and headroom."""
    sock = ctx.socket(zmq.ROUTER)
    num_token_ids = max_model_len + max_num_encoder_tokens
    max_frame_bytes = 4 * num_token_ids + REQUEST_FRAME_HEADROOM_BYTES  # int32 token ids
    ClientRouter.configure(sock, max_frame_bytes, CLIENT_LINGER_MS)
    try:
        endpoints.bind(sock, config.client_address, "--client-address")
    except AddressInUseError:
        sock.close(linger=0)
        raise
    return ClientRouter(sock, config.max_client_backlog_bytes, config.max_client_frames_per_step)
