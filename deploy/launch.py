"""`kvserve launch`: start one engine and N worker processes on this host and supervise them.

A worker that fails is replaced, with the rest of its generation, up to --max-worker-restarts
times (the engine recovers the requests, DESIGN.md §8); past that, or when the engine fails, the
whole deployment comes down: the launcher joins every process with a deadline, then terminates
it, then kills it. Ctrl-C or SIGTERM stops the engine, which stops the workers. Children use the
spawn start method and are named `engine-core`, `worker-R`.
"""

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import TypeVar

from deploy.flags import UsageError
from deploy.logs import setup_logging
from engine_core.net.address import AddressInUseError
from engine_core.net.curve import check_secure
from engine_core.net.endpoints import check_free, free_tcp_ports
from protocol.config import EngineConfig, WorkerConfig

logger = logging.getLogger(__name__)
C = TypeVar("C", EngineConfig, WorkerConfig)

JOIN_TIMEOUT_S = 5.0  # a child gets this long to exit on its own before SIGTERM
DEFAULT_MASTER_PORT = WorkerConfig().master_port
TERMINATE_TIMEOUT_S = 3.0  # then this long after SIGTERM before SIGKILL
SUPERVISE_POLL_S = 0.5
RESTART_BACKOFF_S = (0.5, 8.0)  # the first restart waits the first, doubling up to the second
STABLE_GENERATION_S = 60.0  # a generation that served this long resets the backoff
PR_SET_PDEATHSIG = 1
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# A failed or timed-out NCCL collective aborts its communicator and raises instead of waiting on
# forever; torch reads this once, when the process group forms.
NCCL_ASYNC_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
POOL_HOST_MEMORY_SHARE = 4  # by default the block pool may take a quarter of physical memory


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no orphan outlives a launcher."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError) as exc:
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def with_pool_host_memory_limit(config: EngineConfig) -> EngineConfig:
    """The config, with max_pool_host_memory_bytes defaulted to a share of this host's memory
    (engine_core/ reads no environment, so the engine's process main measures it)."""
    if config.max_pool_host_memory_bytes is not None:
        return config
    limit = physical_memory_bytes() // POOL_HOST_MEMORY_SHARE
    return _replace(config, max_pool_host_memory_bytes=limit)


@contextlib.contextmanager
def kv_transfer_address_for(config: EngineConfig) -> Iterator[EngineConfig]:
    """A prefill engine's config with --kv-transfer-address defaulted to a private ipc folder
    (0700, for decode engines on this host), removed when the block ends; the config as given
    otherwise. (An engine under `kvserve launch` ends through os._exit: no atexit runs there.)"""
    if config.kv_role != "prefill" or config.kv_transfer_address is not None:
        yield config
        return
    folder = tempfile.mkdtemp(prefix="kvserve-kv-transfer-")
    try:
        yield _replace(config, kv_transfer_address=f"ipc://{folder}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def enable_nccl_async_errors() -> None:
    """Set before torch.distributed forms a group; a value the user set is kept."""
    name, value = NCCL_ASYNC_ERROR_HANDLING
    os.environ.setdefault(name, value)


def engine_entry(config: EngineConfig, log_level: str) -> None:
    die_with_parent()
    setup_logging("engine", log_level)
    from engine_core.service.engine_process import run

    with kv_transfer_address_for(with_pool_host_memory_limit(config)) as engine_config:
        code = run(engine_config)
    sys.exit(code)


def worker_entry(config: WorkerConfig, log_level: str) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine, which stops us
    setup_logging(f"worker-{config.rank}", log_level)
    share_cpu_threads(config.tp_size, config.cpu_threads)
    enable_nccl_async_errors()
    from worker.worker_process import run

    sys.exit(run(config))


def share_cpu_threads(num_local_ranks: int, cpu_threads: int | None = None) -> None:
    """Give each local rank its share of the host's cores (N ranks with N threads each would
    thrash), or the `cpu_threads` its config asks for.

    Every core, the engine's and the front end's included: they sleep between their short
    bursts. Served on an idle 2-core host (48 prompts of 256/128, 16 at a time), one rank with
    2 threads gave 115 output tok/s against 77 with 1. A host whose other processes stay busy is
    the exception: a rank's threads then stall at every GEMM's barrier while one of them is
    descheduled (2 threads ran 3x slower than 1 beside one busy process), and `--cpu-threads`
    should leave those processes their cores.
    """
    import torch

    share = max(1, (os.cpu_count() or 1) // num_local_ranks)
    torch.set_num_threads(share if cpu_threads is None else cpu_threads)


def worker_configs(engine_config: EngineConfig, base: WorkerConfig) -> list[WorkerConfig]:
    """One config per rank: the engine's address, TP size, cache settings and step size, the
    base's rest. Every rank runs on this host, so its local rank is its rank, which picks its
    device (ranks past the device count share devices)."""
    cache = engine_config.cache
    shared = {
        "tp_size": engine_config.tp_size,
        "engine_address": engine_config.worker_address,
        "block_size": cache.block_size,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "max_num_batched_tokens": engine_config.scheduler.max_num_batched_tokens,
        "max_num_seqs": engine_config.scheduler.max_num_seqs,
        "max_model_len": engine_config.scheduler.max_model_len,
    }
    return [
        _replace(base, rank=rank, local_rank=rank, **shared)
        for rank in range(engine_config.tp_size)
    ]


def _replace(config: C, **changes: object) -> C:
    import msgspec

    return msgspec.structs.replace(config, **changes).checked()


class Deployment:
    """An engine and its workers, started together and torn down together.

    Invariants: `processes` holds the engine first, then the workers in rank order; once
    `stop` returns, none of them is alive.
    """

    def __init__(
        self, engine_config: EngineConfig, workers: list[WorkerConfig], log_level: str
    ) -> None:
        self._spawn = multiprocessing.get_context("spawn")
        engine = self._spawn.Process(
            target=engine_entry, args=(engine_config, log_level), name="engine-core"
        )
        self.worker_configs = workers
        self.log_level = log_level
        self.processes: list[BaseProcess] = [engine, *self._worker_processes()]
        self.engine_config = engine_config
        self.num_restarts = 0  # worker generations replaced so far
        self._num_quick_restarts = 0  # in a row, each of a generation that died young
        self._generation_start = time.monotonic()

    def _worker_processes(self) -> list[BaseProcess]:
        return [
            self._spawn.Process(
                target=worker_entry, args=(config, self.log_level), name=f"worker-{config.rank}"
            )
            for config in self.worker_configs
        ]

    def start(self) -> None:
        for process in self.processes:
            process.start()
        logger.info("started %s", ", ".join(f"{p.name} (pid {p.pid})" for p in self.processes))

    @property
    def engine(self) -> BaseProcess:
        return self.processes[0]

    def supervise(self) -> int:
        """Block until the deployment ends: 0 when it stopped cleanly, 1 when a child failed.
        A failed worker is replaced with its whole generation while restarts remain."""
        sentinels = {process.sentinel: process for process in self.processes}
        while sentinels:
            ready = multiprocessing.connection.wait(list(sentinels), SUPERVISE_POLL_S)
            for sentinel in ready:
                process = sentinels.pop(sentinel)
                process.join(JOIN_TIMEOUT_S)
                if process.exitcode == EXIT_OK:
                    if process is self.engine:
                        return self.stop()
                    continue  # told to stop by the engine, which is stopping too
                if process is not self.engine and self._can_restart():
                    self._restart_workers(process)
                    sentinels = {p.sentinel: p for p in self.processes if p.is_alive()}
                    break
                logger.error(
                    "%s exited with code %s: stopping the deployment",
                    process.name,
                    process.exitcode,
                )
                self.stop()
                is_usage = process is self.engine and process.exitcode == EXIT_USAGE
                return EXIT_USAGE if is_usage else EXIT_FAILED
        return EXIT_OK

    def _can_restart(self) -> bool:
        max_restarts = self.engine_config.max_worker_restarts
        return self.num_restarts < max_restarts and self.engine.is_alive()

    def _restart_workers(self, failed: BaseProcess) -> None:
        """Replace the whole generation: the engine tells the survivors to exit (one may be stuck
        in a collective with the failed rank), and any still alive after the grace is killed, so
        the new rank 0 can take the rendezvous port."""
        self.num_restarts += 1
        old = self.processes[1:]
        logger.warning(
            "%s exited with code %s: replacing the worker ranks (restart %d of %d)",
            failed.name,
            failed.exitcode,
            self.num_restarts,
            self.engine_config.max_worker_restarts,
        )
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in old:
            process.join(max(0.0, deadline - time.monotonic()))
        _end_processes(old, JOIN_TIMEOUT_S)
        if time.monotonic() - self._generation_start >= STABLE_GENERATION_S:
            self._num_quick_restarts = 0  # not a crash loop: restart at the first backoff
        low_s, high_s = RESTART_BACKOFF_S
        self.engine.join(min(high_s, low_s * 2**self._num_quick_restarts))
        self._num_quick_restarts += 1
        if not self.engine.is_alive():
            self.processes = [self.engine]
            return  # the engine ended meanwhile: supervise() sees it and stops
        self.processes = [self.engine, *self._worker_processes()]
        self._generation_start = time.monotonic()
        for process in self.processes[1:]:
            process.start()
        logger.info("started %s", ", ".join(f"{p.name} (pid {p.pid})" for p in self.processes[1:]))

    def stop(self) -> int:
        """Stop the engine (it drains, then stops the workers), then join, terminate and kill
        what remains."""
        if self.engine.is_alive():
            self.engine.terminate()  # SIGTERM: the engine drains what is in flight, then Shutdown
        join_timeout_s = self.engine_config.shutdown_timeout_s + JOIN_TIMEOUT_S
        deadline = time.monotonic() + join_timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        _end_processes(self.processes, join_timeout_s)
        failed = [p for p in self.processes if p.exitcode not in (EXIT_OK, -signal.SIGTERM)]
        return EXIT_FAILED if failed else EXIT_OK


def _end_processes(processes: list[BaseProcess], waited_s: float) -> None:
    """Terminate, then kill, whatever is still alive after it was given `waited_s` to exit."""
    for process in processes:
        if process.is_alive():
            logger.warning("%s still alive after %.0f s: terminating", process.name, waited_s)
            process.terminate()
            process.join(TERMINATE_TIMEOUT_S)
        if process.is_alive():
            logger.warning("%s ignored SIGTERM: killing", process.name)
            process.kill()
            process.join(TERMINATE_TIMEOUT_S)


class InterruptOnce:
    """A SIGTERM handler that raises KeyboardInterrupt the first time only: a second signal (a
    supervisor repeating itself) must not cut short the teardown the first one began."""

    def __init__(self) -> None:
        self.is_interrupted = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.is_interrupted:
            logger.info("signal %d: already stopping", signum)
            return
        self.is_interrupted = True
        raise KeyboardInterrupt


def check_addresses(engine_config: EngineConfig, base_worker: WorkerConfig) -> WorkerConfig:
    """Refuse, before anything starts, addresses another deployment serves on (AddressInUseError
    naming the flag); the worker config, with a free rendezvous port when the default is taken."""
    check_secure(engine_config)
    check_free(engine_config.client_address, "--client-address")
    check_free(engine_config.worker_address, "--worker-address")
    if engine_config.metrics_port is not None:
        metrics_address = f"tcp://{engine_config.metrics_host}:{engine_config.metrics_port}"
        check_free(metrics_address, "--metrics-port")
    kv_events = engine_config.kv_events
    if kv_events.enable_kv_cache_events:
        for address in filter(None, [kv_events.endpoint, kv_events.replay_endpoint]):
            check_free(address, "--kv-events-config")
    if engine_config.tp_size == 1:
        return base_worker  # one rank forms no group: the port is never bound
    rendezvous = f"tcp://{base_worker.master_addr}:{base_worker.master_port}"
    try:
        check_free(rendezvous, "--master-port")
    except AddressInUseError:
        if base_worker.master_port != DEFAULT_MASTER_PORT:
            raise
        (port,) = free_tcp_ports(1)
        logger.info("rendezvous port %d is taken: the ranks meet on %d", DEFAULT_MASTER_PORT, port)
        return _replace(base_worker, master_port=port)
    return base_worker


def run_launch(engine_config: EngineConfig, base_worker: WorkerConfig, log_level: str) -> int:
    """`kvserve launch`: start, supervise until the end or Ctrl-C, and tear everything down."""
    try:
        base_worker = check_addresses(engine_config, base_worker)
    except AddressInUseError as exc:
        raise UsageError(str(exc)) from None
    deployment = Deployment(engine_config, worker_configs(engine_config, base_worker), log_level)

    signal.signal(signal.SIGTERM, InterruptOnce())
    deployment.start()
    try:
        return deployment.supervise()
    except KeyboardInterrupt:
        logger.info("interrupted: stopping the deployment")
        return deployment.stop()
