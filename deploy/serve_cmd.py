"""Runs `kvserve serve` (and `kvserve-api`): the HTTP front end on uvicorn, over engines that are
already running or over a deployment it launches and supervises like `kvserve launch`.

Flags are parsed in commands.py; this module only runs what they describe.
"""

import logging
import signal
import threading

import uvicorn

from api_server.app import ApiSettings, create_app
from deploy.flags import UsageError
from deploy.launch import EXIT_FAILED, EXIT_OK, Deployment, check_addresses, worker_configs
from engine_core.net.address import AddressInUseError
from engine_core.net.endpoints import check_free
from protocol.config import EngineConfig, WorkerConfig

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 10.0  # streams still open when a stop is asked get this long to end
SUPERVISOR_JOIN_MARGIN_S = 15.0  # beyond the engine's drain: the launcher's own join deadlines


def _ignore_signal(signum: int, frame: object) -> None:
    """Installed before uvicorn, which re-raises the signal that stopped it once it returns:
    by then the stop is under way here, and the default handler would end the process early."""
    logger.debug("signal %d after the HTTP server stopped", signum)


def _http_server(settings: ApiSettings, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        loop="auto",  # uvloop when installed
        http="auto",  # httptools when installed
        log_config=None,  # deploy/logs.py already formats every record
        access_log=False,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
    )
    return uvicorn.Server(config)


def serve_http(settings: ApiSettings, host: str, port: int) -> int:
    """Serve until SIGINT or SIGTERM; 0 after a clean stop, 1 when the server failed."""
    try:
        check_free(f"tcp://{host}:{port}", "--port")
    except AddressInUseError as exc:
        raise UsageError(str(exc)) from None
    server = _http_server(settings, host, port)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _ignore_signal)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILED


def serve_with_deployment(
    settings: ApiSettings,
    host: str,
    port: int,
    engine_config: EngineConfig,
    base_worker: WorkerConfig,
    log_level: str,
) -> int:
    """Launch an engine and its workers, serve HTTP in front of them, and stop both together:
    the deployment ending stops the server, and the server stopping stops the deployment."""
    try:
        base_worker = check_addresses(engine_config, base_worker)
        check_free(f"tcp://{host}:{port}", "--port")
    except AddressInUseError as exc:
        raise UsageError(str(exc)) from None
    deployment = Deployment(engine_config, worker_configs(engine_config, base_worker), log_level)
    server = _http_server(settings, host, port)
    outcome: list[int] = []

    def supervise() -> None:
        outcome.append(deployment.supervise())
        server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _ignore_signal)
    deployment.start()
    supervisor = threading.Thread(target=supervise, name="supervisor", daemon=True)
    supervisor.start()
    try:
        server.run()
    finally:
        if deployment.engine.is_alive():
            deployment.engine.terminate()  # the engine drains; the supervisor joins everything
        supervisor.join(engine_config.shutdown_timeout_s + SUPERVISOR_JOIN_MARGIN_S)
    if not outcome:
        logger.error("the deployment did not stop in time")
        return EXIT_FAILED
    return outcome[0] if server.started else EXIT_FAILED
