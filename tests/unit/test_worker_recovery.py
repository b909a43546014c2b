"""The restart budget of rank recovery (DESIGN.md §8): faults are recovered while restarts remain,
a fault a new generation would repeat never is, and a new generation must fit the pool."""

import pytest

from engine_core.service.recovery import WorkerRecovery
from engine_core.workers.handshake import HandshakeError
from engine_core.workers.rank_watch import WorkerGroupError
from protocol import PROTOCOL_VERSION
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.worker_messages import WorkerHello
from worker.models.registry import get_model_info

INFO = get_model_info("checksum", 16)


def _recovery(max_worker_restarts: int) -> WorkerRecovery:
    config = EngineConfig(max_worker_restarts=max_worker_restarts).checked()
    return WorkerRecovery(config, KVCacheConfig(64, INFO.kv_cache_groups), INFO)


def _hello(num_blocks: int, model: str = "checksum") -> WorkerHello:
    info = get_model_info(model, 16)
    return WorkerHello(PROTOCOL_VERSION, 0, 1, 1, "host", "cpu", info, num_blocks)


def test_faults_are_recovered_until_the_budget_is_spent() -> None:
    recovery = _recovery(2)
    fault = WorkerGroupError("worker rank 0 (pid 7) exited", "exited")
    assert recovery.can_recover(fault)
    recovery.num_restarts = 2
    assert not recovery.can_recover(fault)
    recovery.check_invariants()


def test_a_disagreement_is_never_recovered() -> None:
    """Ranks that sample different tokens are a bug a new generation would repeat."""
    disagreement = WorkerGroupError("rank(s) [1] differ", "protocol", is_recoverable=False)
    assert not _recovery(3).can_recover(disagreement)


def test_zero_restarts_is_fail_stop() -> None:
    assert not _recovery(0).can_recover(WorkerGroupError("rank 0 exited", "exited"))


def test_a_new_generation_must_hold_the_pool_and_run_the_model() -> None:
    recovery = _recovery(3)
    recovery.check_new_generation({0: _hello(64)})  # exactly the pool: fine
    with pytest.raises(HandshakeError, match="can hold 63 blocks, expected at least the pool's 64"):
        recovery.check_new_generation({0: _hello(63)})
    with pytest.raises(HandshakeError, match="rank 0 of the new worker generation: name is"):
        recovery.check_new_generation({0: _hello(64, "tiny-llama")})
