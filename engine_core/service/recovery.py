"""WorkerRecovery: replacing a lost worker generation with a new one (DESIGN.md §8), so that a
rank fault costs clients latency, never a request or a token.

It retires the old generation, requeues every request to recompute, and waits for the new ranks'
handshake; it never steps, and it gives up (fail-stop) past max_worker_restarts.
"""

import logging
import time
from collections.abc import Callable

import msgspec

from engine_core.core import EngineCore
from engine_core.telemetry.metrics import EngineMetrics
from engine_core.workers.handshake import HandshakeError, describe_model_difference
from engine_core.workers.rank_watch import WorkerGroupError
from engine_core.workers.worker_group import WorkerGroup
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import ModelInfo, WorkerHello

logger = logging.getLogger(__name__)


class WorkerRecovery:
    """The engine's restart budget and the rejoin of a new generation.

    Invariants: `0 <= num_restarts <= max_worker_restarts`; `kv_cache_config` is the layout
    agreed at startup, which every later generation must accept unchanged.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        model_info: ModelInfo,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.max_worker_restarts = config.max_worker_restarts
        self.rejoin_timeout_s = config.worker_rejoin_timeout_s
        self.kv_cache_config = kv_cache_config
        self.model_info = model_info
        self.metrics = metrics
        self.num_restarts = 0

    def can_recover(self, error: WorkerGroupError) -> bool:
        return error.is_recoverable and self.num_restarts < self.max_worker_restarts

    def recover(
        self,
        core: EngineCore,
        workers: WorkerGroup,
        error: WorkerGroupError,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        """Retire the generation, requeue every request, and admit the next generation once
        each rank is Ready; HandshakeError when none joins in time or one cannot hold the pool.
        `on_wait` runs every slice of the handshake's waits (the server serving its clients)."""
        fault_time = time.monotonic()
        self.num_restarts += 1
        generation = workers.generation
        logger.warning(
            "worker generation %d lost (%s: %s): restart %d of %d, %d requests to recompute",
            generation,
            error.cause,
            error,
            self.num_restarts,
            self.max_worker_restarts,
            core.num_unfinished_requests,
        )
        workers.retire_generation(f"worker generation {generation} is retired: {error}")
        core.requeue_for_new_workers()
        deadline = fault_time + self.rejoin_timeout_s
        self.check_new_generation(workers.wait_for_hellos(deadline, on_wait))
        first_step_id = core.next_step_id
        config = msgspec.structs.replace(self.kv_cache_config, first_step_id=first_step_id)
        workers.send_kv_cache_config(config)
        workers.wait_for_ready(config.num_blocks, deadline, on_wait)
        recovery_s = time.monotonic() - fault_time
        logger.warning(
            "worker generation %d ready %.2f s after the fault: serving resumes at step %d",
            workers.generation,
            recovery_s,
            first_step_id,
        )
        if self.metrics is not None:
            self.metrics.on_worker_restart(error.cause, recovery_s)

    def check_new_generation(self, hellos: dict[int, WorkerHello]) -> None:
        """A new generation serves the same model and holds at least the pool's blocks."""
        num_blocks = self.kv_cache_config.num_blocks
        for rank, hello in sorted(hellos.items()):
            difference = describe_model_difference(self.model_info, hello.model_info)
            if difference is not None:
                raise HandshakeError(f"rank {rank} of the new worker generation: {difference}")
            if hello.num_blocks_available < num_blocks:
                raise HandshakeError(
                    f"rank {rank} of the new worker generation can hold "
                    f"{hello.num_blocks_available} blocks, expected at least the pool's "
                    f"{num_blocks}"
                )

    def check_invariants(self) -> None:
        assert 0 <= self.num_restarts <= self.max_worker_restarts, (
            f"{self.num_restarts} restarts, at most {self.max_worker_restarts}"
        )
