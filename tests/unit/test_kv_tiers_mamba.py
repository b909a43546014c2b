"""Mamba states below the pool: a seeded fuzz of the engine's step loop with full attention and an
align-mode Mamba group over a small pool, with host and disk tiers, synchronous and asynchronous.

The stand-in workers (test_mamba_engine_fuzz.py) load each request's starting state through its
table and check that the block holds the state of exactly that prefix; here they also run each
step's tier copies on those modelled states. So a state copied out before it was written, a
tier slot read before it was written, or a copy-in into the wrong block fails the run.
"""

import random

import pytest
from test_mamba_engine_fuzz import (
    MambaHarness,
    run_random_workload,
)

from protocol.buffers import unpack_int32
from protocol.worker_messages import KVTransfers

NUM_STEPS = 1200

State = tuple[int, ...] | None  # the prefix a block's state sums up; None: an attention page


def _pairs(data: bytes) -> list[tuple[int, int]]:
    values = unpack_int32(data)
    return list(zip(values[::2], values[1::2], strict=True))


class StateTierMemory:
    """The ranks' host and disk slots over MambaStateExecutor's modelled block memory."""

    def __init__(self, memory: dict[int, tuple[int, ...]]) -> None:
        self.memory = memory  # the executor's own: block id -> the prefix its state sums up
        self.host: dict[int, State] = {}
        self.disk: dict[int, State] = {}
        self.num_states_in = 0  # Mamba states copied into the pool from the host tier

    def run(self, transfers: KVTransfers) -> list[int]:
        for host_slot, disk_slot in _pairs(transfers.host_to_disk):
            assert host_slot in self.host, f"host slot {host_slot} read before written"
            self.disk[disk_slot] = self.host[host_slot]
        for block_id, host_slot in _pairs(transfers.device_to_host):
            self.host[host_slot] = self.memory.get(block_id)
        for disk_slot, host_slot in _pairs(transfers.disk_to_host):
            assert disk_slot in self.disk, f"disk slot {disk_slot} read before written"
            self.host[host_slot] = self.disk[disk_slot]
        for host_slot, block_id in _pairs(transfers.host_to_device):
            assert host_slot in self.host, f"host slot {host_slot} read before written"
            state = self.host[host_slot]
            if state is None:
                self.memory.pop(block_id, None)
            else:
                self.memory[block_id] = state
                self.num_states_in += 1
        return []


class MambaTierHarness(MambaHarness):
    """MambaHarness with a host tier of 6 slots and a disk tier of 16 under its 24 blocks."""

    def __init__(self, **scheduler_fields: object) -> None:
        super().__init__("align", True, num_host_slots=6, num_disk_slots=16, **scheduler_fields)
        self.state_tiers = StateTierMemory(self.executor.memory)
        self.executor.tier_memory = self.state_tiers  # type: ignore[assignment]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mamba_states_come_back_from_the_tiers_as_they_were_stored(
    async_scheduling: bool,
) -> None:
    rng = random.Random(5)
    harness = MambaTierHarness(
        max_num_batched_tokens=24,
        max_num_seqs=6,
        long_prefill_token_threshold=10,
        async_scheduling=async_scheduling,
    )
    run_random_workload(harness, rng, NUM_STEPS, 6)
    stats = harness.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert stats.host_hits > 0 and stats.blocks_to_disk > 0
    assert harness.state_tiers.num_states_in > 0, "no Mamba state came back from a tier"
