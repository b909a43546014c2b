"""Tiers below the pool through the real service (launcher, engine, workers): with a device pool
so small that prefixes come back from the host tier or the disk tier, every served token equals
the model's reference (what the service serves with tiers off), at TP=1 and TP=2, under
preemption and after a rank is killed; the disk files are gone once the deployment stops.
"""

import os
import random
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.make_checkpoint import CheckpointSpec, make_checkpoint
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.kv_cache_spec import bytes_per_block
from protocol.sampling import SamplingParams
from tests.integration.conftest import (
    Processes,
    launch,
    stop_launch,
    wait_engine_serving,
    wait_for,
)
from tests.integration.served_requests import (
    Expected,
    mixed_params,
    reference_tokens,
    serve_and_check,
)
from worker.models.registry import get_model_info

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT_S = 180.0
BLOCK_SIZE = 4
MAX_MODEL_LEN = 48  # 12 blocks: a request fits the 15 usable ones
PREFIX_LEN = 24  # tokens each group's prompts share: 6 blocks
NUM_GROUPS = 3


@dataclass(frozen=True)
class TierCase:
    model: str
    tp_size: int
    num_gpu_blocks: int
    num_host_slots: int  # per rank
    num_disk_slots: int  # per rank; 0: no disk tier

    @property
    def id(self) -> str:
        disk = f"-disk{self.num_disk_slots}" if self.num_disk_slots else ""
        return f"{self.model}-tp{self.tp_size}-host{self.num_host_slots}{disk}"


# A pool of 15 usable blocks holds about one request (9 blocks at most): each group's prefix is
# pushed out by the next group's before it comes back.
CASES = [
    TierCase("checksum", 2, 16, 64, 0),
    TierCase("tiny-llama", 1, 16, 4, 64),  # host victims go to disk and come back from it
    TierCase("tiny-llama", 2, 16, 8, 64),
    TierCase("tiny-mla", 1, 16, 64, 0),  # one latent per token, replicated on every rank
    TierCase("tiny-llama-hybrid", 2, 28, 8, 64),  # full and sliding-window groups: 2 ids a block
    TierCase("tiny-mamba-hybrid", 1, 16, 64, 0),  # attention pages and Mamba states
]


def tier_flags(case: TierCase, disk_dir: Path) -> list[str]:
    """Budgets over all ranks together, in slots of one rank's block."""
    info = get_model_info(case.model, BLOCK_SIZE, tp_size=case.tp_size)
    block_bytes = bytes_per_block(info.kv_cache_groups, case.tp_size) * case.tp_size
    flags = ["--kv-offload-host-bytes", str(case.num_host_slots * block_bytes)]
    if case.num_disk_slots:
        flags += ["--kv-offload-disk-bytes", str(case.num_disk_slots * block_bytes)]
        flags += ["--kv-offload-disk-dir", str(disk_dir)]
    return flags


def launch_tiered(
    processes: Processes, addresses: dict, case: TierCase, disk_dir: Path, *extra: str
) -> None:
    argv = ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--num-gpu-blocks-override", str(case.num_gpu_blocks), *tier_flags(case, disk_dir)]
    launch(processes, addresses, case.tp_size, case.model, *argv, "--check-invariants", *extra)


def group_prompts(seed: int) -> list[list[list[int]]]:
    """NUM_GROUPS groups of two prompts; the prompts of a group share PREFIX_LEN tokens."""
    rng = random.Random(seed)
    groups = []
    for _ in range(NUM_GROUPS):
        prefix = [rng.randrange(3, 500) for _ in range(PREFIX_LEN)]
        groups.append([prefix + [rng.randrange(3, 500) for _ in range(5 + i)] for i in range(2)])
    return groups


def serve_rounds(
    client: EngineClient, expected: Expected | None, num_rounds: int, seed: int
) -> list[list[int]]:
    """Each group in turn, one request at a time, `num_rounds` times over: from the second round
    on, a group's prefix was evicted from the pool by the others and comes back from a tier.
    Every request's tokens must be `expected`'s (when given); returns them in order."""
    served: list[list[int]] = []
    for _ in range(num_rounds):
        for group in group_prompts(seed):
            for prompt in group:
                idx = len(served)
                (params,) = mixed_params(1, 4, first_idx=idx)
                req_id = f"req-{idx}"
                client.add_request(make_request(req_id, prompt, params))
                result = client.run_until_finished([req_id], CLIENT_TIMEOUT_S)[req_id]
                assert result.error is None, f"{req_id} failed: {result.error}"
                if expected is not None:
                    tokens = expected(idx, prompt, params)
                    assert result.token_ids == tokens, f"{req_id}: {result.token_ids} != {tokens}"
                served.append(result.token_ids)
    return served


def assert_tier_use(stats: dict, case: TierCase) -> None:
    """Hits came from each tier configured; each hit counts once, in the tier it was found in,
    and every one (a disk hit too) is copied in from the host tier."""
    assert stats["prefix_cache_blocks_from_host"] > 0, f"no block came in from the host: {stats}"
    if case.num_disk_slots:
        assert stats["prefix_cache_disk_hits"] > 0, f"no hit came from the disk tier: {stats}"
    else:
        assert stats["prefix_cache_host_hits"] > 0, f"no hit came from the host tier: {stats}"
    assert stats["prefix_cache_disk_read_failures"] == 0, stats
    assert stats["prefix_cache_disk_write_failures"] == 0, stats
    assert stats["kv_cache_usage"] == 0.0, f"blocks leaked: {stats}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_hits_through_the_tiers_serve_the_reference_tokens(
    processes: Processes, addresses: dict, tmp_path: Path, case: TierCase
) -> None:
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    launch_tiered(processes, addresses, case, disk_dir)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
        serve_rounds(client, reference_tokens(case.model), num_rounds=2, seed=case.tp_size)
        stats = client.get_stats()
        if case.num_disk_slots:  # one file per rank while the ranks run
            assert len(os.listdir(disk_dir)) == case.tp_size, os.listdir(disk_dir)
    stop_launch(processes)
    assert_tier_use(stats, case)
    assert os.listdir(disk_dir) == [], "a rank left its disk tier file behind"
    log = processes.log("launch")
    assert len(re.findall(r"worker\.kv_tiers: host tier: \d+ slots", log)) == case.tp_size


@pytest.mark.timeout(300)
def test_preemption_with_tiers_serves_the_reference_tokens(
    processes: Processes, addresses: dict, tmp_path: Path
) -> None:
    """Six requests at once in a pool of 12 usable blocks, where one request grows to 11 and a
    second of its group to 5 more: preempted requests resume on prefixes that went down to the
    tiers meanwhile. A pool this small preempts even when the client's requests reach the
    engine 50 ms apart (at 20 blocks, requests sent 50 ms apart finished without one)."""
    case = TierCase("tiny-llama", 2, 13, 8, 64)
    (tmp_path / "disk").mkdir()
    launch_tiered(processes, addresses, case, tmp_path / "disk", "--max-num-batched-tokens", "32")
    expected = reference_tokens(case.model)
    prompts = [prompt for group in group_prompts(seed=5) for prompt in group]
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
        for wave in range(2):
            first_idx = wave * len(prompts)
            params = mixed_params(len(prompts), 12, first_idx=first_idx)
            serve_and_check(
                client, prompts, params, expected, CLIENT_TIMEOUT_S, first_idx=first_idx
            )
        stats = client.get_stats()
    stop_launch(processes)
    assert stats["num_preemptions"] > 0, f"expected preemption in {case.num_gpu_blocks}: {stats}"
    assert_tier_use(stats, case)


@pytest.mark.timeout(300)
def test_a_killed_rank_costs_the_tiers_and_no_token(
    processes: Processes, addresses: dict, tmp_path: Path
) -> None:
    """Rank 0 is killed while it serves with both tiers full of prefixes: the next generation
    starts with empty tiers, the killed rank's file is cleared away, and every token is still
    the reference's."""
    case = TierCase("checksum", 2, 16, 4, 64)
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    launch_tiered(processes, addresses, case, disk_dir)
    expected = reference_tokens(case.model)
    with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
        wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
        serve_rounds(client, expected, num_rounds=2, seed=9)
        log = processes.log("launch")
        pid = int(re.findall(r"rank 0 joined: pid (\d+)", log)[-1])
        prompts = [prompt for group in group_prompts(seed=9) for prompt in group]
        params = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in prompts]
        req_ids = [f"after-{idx}" for idx in range(len(prompts))]
        for req_id, prompt, param in zip(req_ids, prompts, params, strict=True):
            client.add_request(make_request(req_id, prompt, param))
        wait_for(
            lambda: (
                client.poll_outputs(0.05) is not None
                and sum(len(client.result(r).token_ids) for r in req_ids) >= 10
            ),
            CLIENT_TIMEOUT_S,
            "the first tokens after the tiers filled",
        )
        os.kill(pid, signal.SIGKILL)
        results = client.run_until_finished(req_ids, CLIENT_TIMEOUT_S)
        for req_id, prompt, param in zip(req_ids, prompts, params, strict=True):
            tokens = expected(0, prompt, param)
            assert results[req_id].token_ids == tokens, f"{req_id} after the kill"
        after_kill = client.get_stats()
        serve_rounds(client, expected, num_rounds=2, seed=10)  # the new tiers serve hits
        stats = client.get_stats()
    stop_launch(processes)
    assert "worker generation 2 ready" in processes.log("launch")
    tier_hits = [
        s["prefix_cache_host_hits"] + s["prefix_cache_disk_hits"] for s in (after_kill, stats)
    ]
    assert tier_hits[1] > tier_hits[0], f"the new generation's tiers served no hit: {stats}"
    assert os.listdir(disk_dir) == [], "the killed rank's disk file outlived the deployment"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), CheckpointSpec(arch="qwen3"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2"])
def test_a_checkpoint_serves_the_same_tokens_with_tiers_on_and_off(
    processes: Processes, addresses: dict, tmp_path: Path, checkpoint: Path, tp_size: int
) -> None:
    """A real model's prefix copied back from the host and disk tiers is bit for bit the one the
    ranks computed, so greedy and seeded tokens equal those of recomputing it (tiers off)."""
    case = TierCase(str(checkpoint), tp_size, 16, 4, 64)  # hits come from the disk tier too
    served: dict[str, list[list[int]]] = {}
    for tiers in ("off", "on"):
        disk_dir = tmp_path / f"disk-{tiers}"
        disk_dir.mkdir()
        argv = ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)]
        argv += ["--num-gpu-blocks-override", str(case.num_gpu_blocks), "--check-invariants"]
        if tiers == "on":
            argv += tier_flags(case, disk_dir)
        launch(processes, addresses, tp_size, str(checkpoint), *argv)
        with EngineClient(addresses["client"], CLIENT_TIMEOUT_S) as client:
            wait_engine_serving(processes, client, CLIENT_TIMEOUT_S)
            expected = None if tiers == "off" else lambda idx, *_: served["off"][idx]
            served[tiers] = serve_rounds(client, expected, num_rounds=3, seed=tp_size)
            stats = client.get_stats()
        stop_launch(processes)
        processes.procs.pop("launch")
        if tiers == "on":
            assert_tier_use(stats, case)
    assert served["on"] == served["off"]
