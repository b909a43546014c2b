"""bench/manager_decisions.py stops a replay at the first decision unlike the peer's, and every
--spec layout of bench/kv_cache_manager.py replays a small trace without leaking a block."""

import pytest

from bench.kv_cache_manager import LAYOUTS, _indexed_blocks, run_kvserve
from bench.manager_decisions import CheckingManager, DecisionMismatch, RecordingManager
from bench.trace import TraceConfig, make_trace
from engine_core.kv_cache.mamba_manager import MambaManager
from engine_core.kv_cache.manager import KVCacheManager


class _ScriptedManager:
    """Answers lookups with the hit lengths given, in order; refuses no allocation."""

    def __init__(self, hit_lengths: list[int]) -> None:
        self.hit_lengths = hit_lengths

    def get_computed_blocks(self, request: object) -> tuple[tuple, int]:
        return (), self.hit_lengths.pop(0)

    def allocate_slots(self, request: object, *args: object) -> object:
        return ()

    def free(self, request: object) -> None:
        pass


def test_checking_stops_at_the_first_differing_hit() -> None:
    requests = [object(), object(), object()]
    checker = CheckingManager(
        _ScriptedManager([0, 16, 32]), requests, [("hit", 0, 0), ("hit", 1, 16), ("hit", 2, 48)]
    )
    checker.get_computed_blocks(requests[0])
    checker.get_computed_blocks(requests[1])
    with pytest.raises(DecisionMismatch, match=r"decision 2 differs: kvserve \('hit', 2, 32\)"):
        checker.get_computed_blocks(requests[2])


def test_checking_notices_a_decision_the_peer_made_and_we_did_not() -> None:
    requests = [object()]
    checker = CheckingManager(_ScriptedManager([0]), requests, [("hit", 0, 0), ("full", 0, 0)])
    checker.get_computed_blocks(requests[0])
    with pytest.raises(DecisionMismatch, match="kvserve made 1 decisions, vllm 2"):
        checker.check_complete()


def test_recording_names_requests_by_their_index() -> None:
    requests = [object(), object()]
    recorder = RecordingManager(_ScriptedManager([5, 7]), requests)
    recorder.get_computed_blocks(requests[1])
    recorder.get_computed_blocks(requests[0])
    assert recorder.decisions == [("hit", 1, 5), ("hit", 0, 7)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_replays_a_small_trace_without_leaking(layout: str) -> None:
    config = TraceConfig(
        num_requests=12,
        system_prompt_min_tokens=64,
        system_prompt_max_tokens=256,
        num_gpu_blocks=128,
        max_running=4,
    )
    results, manager = run_kvserve(make_trace(config), repeats=1, layout=layout)
    assert results[0].num_hit_tokens > 0
    assert len(manager.coordinator.single_type_managers) == (1 if layout == "full" else 2)
    manager.check_invariants()


def test_the_window_layout_replays_under_a_retention_interval_with_fewer_entries() -> None:
    """A 512-token interval keeps, of each 32 window blocks, the 16 a 256-token window reads."""
    config = TraceConfig(
        num_requests=12,
        system_prompt_min_tokens=1024,
        system_prompt_max_tokens=2048,
        num_gpu_blocks=8192,
        max_running=4,
    )
    trace = make_trace(config)
    dense = run_kvserve(trace, repeats=1, layout="full+sliding")[1]
    sparse = run_kvserve(trace, repeats=1, layout="full+sliding", retention_interval=512)[1]
    assert _num_indexed(sparse, 1) < _num_indexed(dense, 1)
    sparse.check_invariants()


def _num_indexed(manager: KVCacheManager, group_id: int) -> int:
    return _indexed_blocks(manager)[f"num_indexed_blocks_group_{group_id}"]


def test_the_mamba_layout_replays_in_chunks_and_hits_kept_states() -> None:
    """Prompts longer than a chunk run over several steps, every block comes back, and later
    requests resume from states that earlier prefills kept in the Mamba group."""
    config = TraceConfig(
        num_requests=12,
        system_prompt_min_tokens=600,
        system_prompt_max_tokens=900,
        num_gpu_blocks=1024,
        max_running=4,
    )
    results, manager = run_kvserve(make_trace(config), repeats=1, layout="full+mamba")
    mamba = manager.coordinator.single_type_managers[1]
    assert isinstance(mamba, MambaManager) and mamba.is_align
    assert results[0].num_hit_tokens > 0 and results[0].num_preemptions == 0
    assert _num_indexed(manager, 1) > 0
    manager.check_invariants()
