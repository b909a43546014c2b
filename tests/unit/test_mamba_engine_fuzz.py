"""Seeded fuzz of the engine's step loop with a Mamba group beside full attention: random
arrivals over shared prefixes in a small pool (prefix hits, block-aligned chunks, preemption,
aborts), synchronous and asynchronous scheduling.

The stand-in workers run each Mamba group's state as a batched kernel would: every request of a
step loads its starting state through its block table before any state is stored. Memory is
modelled per block as the prefix of tokens the stored state summarises, so a false hit, a lost
or overwritten checkpoint, or a checkpoint read in the step that writes it fails the run.
"""

import random
from collections.abc import Callable

import pytest
from fake_executor import FakeExecutor, Harness, next_token, reference_tokens

from protocol.config import CacheConfig, EngineConfig, SchedulerConfig
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    cdiv,
)
from protocol.worker_messages import ModelInfo, ModelRunnerOutput, SchedulerOutput

BLOCK_SIZE = 4
NUM_STEPS = 1500


class MambaStateExecutor(FakeExecutor):
    """FakeExecutor whose Mamba groups load and store modelled states through the tables."""

    def __init__(
        self, specs: list[KVCacheSpec], is_align: bool, max_num_batched_tokens: int
    ) -> None:
        super().__init__(64, BLOCK_SIZE, max_num_batched_tokens)
        self.specs = specs
        self.is_align = is_align
        self.memory: dict[int, tuple[int, ...]] = {}  # block id -> the prefix its state sums up
        self.num_resumed_states = 0  # loads of a state another step or request stored
        self._stores: list[tuple[int, tuple[int, ...]]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._stores = []
        output = super().execute_model(scheduler_output)
        for block_id, prefix in self._stores:  # after every load of the step
            self.memory[block_id] = prefix
        return output

    def _run(self, handle: int, num_tokens: int) -> int:
        state = self.requests[handle]
        start = state.num_computed_tokens
        end = start + num_tokens
        assert num_tokens >= 1 and end <= len(state.tokens), (handle, start, end)
        for spec, table in zip(self.specs, state.block_ids, strict=True):
            if not isinstance(spec, MambaSpec):
                assert len(table) * BLOCK_SIZE >= end and 0 not in table[-1:], (handle, table)
                continue
            if start:
                block_id = table[self._state_idx(start)]
                expected = tuple(state.tokens[:start])
                assert block_id and self.memory.get(block_id) == expected, (
                    f"handle {handle} starts from block {block_id} holding "
                    f"{self.memory.get(block_id)}, expected the state after {expected}"
                )
                self.num_resumed_states += 1
            block_id = table[self._state_idx(end)]
            assert block_id, f"handle {handle} stores its state in the null block"
            self._stores.append((block_id, tuple(state.tokens[:end])))
        state.num_computed_tokens = end
        if end < len(state.tokens):
            return 0
        token = next_token(state.tokens, self.vocab_size)
        state.tokens.append(token)
        return token

    def _state_idx(self, num_tokens: int) -> int:
        return cdiv(num_tokens, BLOCK_SIZE) - 1 if self.is_align else 0


class MambaHarness(Harness):
    """Harness over full attention and one Mamba group, with MambaStateExecutor as workers."""

    def __init__(
        self,
        mode: str,
        enable_prefix_caching: bool,
        num_host_slots: int = 0,
        num_disk_slots: int = 0,
        **scheduler_fields: object,
    ) -> None:
        mamba = MambaSpec(BLOCK_SIZE, ((2, 3),), "float32", mamba_cache_mode=mode)
        specs: list[KVCacheSpec] = [FullAttentionSpec(BLOCK_SIZE, 1, 8, "float32"), mamba]
        groups = [KVCacheGroupSpec([f"layer.{idx}"], spec) for idx, spec in enumerate(specs)]
        model_info = ModelInfo("fake-mamba", 64, [0], 64, groups)
        config = EngineConfig(
            check_invariants=True,
            cache=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(**scheduler_fields),
        ).checked()
        self.num_blocks = 24
        self.vocab_size = 64
        is_align = mode == "align" and enable_prefix_caching
        self.executor = MambaStateExecutor(specs, is_align, config.scheduler.max_num_batched_tokens)
        kv_cache_config = KVCacheConfig(
            self.num_blocks, groups, num_host_slots=num_host_slots, num_disk_slots=num_disk_slots
        )
        self.start_engine(config, kv_cache_config, model_info)


def _check_state_blocks(harness: MambaHarness) -> None:
    """Each running request's current state block is the same in the engine and the workers."""
    kv = harness.scheduler.kv_cache_manager
    for request in harness.scheduler.running:
        engine_table = kv.get_block_ids(request.req_id)[1]
        worker_table = harness.executor.requests[request.handle].block_ids[1]
        assert len(worker_table) == len(engine_table) and engine_table[-1] == worker_table[-1], (
            f"{request.req_id}: workers hold {worker_table}, engine {engine_table}"
        )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("mode", "enable_prefix_caching", "seed"),
    [("align", True, 1), ("none", True, 2), ("align", False, 3)],
)
def test_random_workload_reads_every_state_where_it_was_stored(
    mode: str, enable_prefix_caching: bool, seed: int, async_scheduling: bool
) -> None:
    rng = random.Random(seed)
    harness = MambaHarness(
        mode,
        enable_prefix_caching,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        long_prefill_token_threshold=10,
        async_scheduling=async_scheduling,
    )
    run_random_workload(harness, rng, NUM_STEPS, 3, after_step=_check_state_blocks)
    assert harness.scheduler.num_preemptions > 10, "the pool should force preemption"
    assert harness.executor.num_resumed_states > 100
    num_hit_tokens = sum(harness.num_cached_tokens.values())
    if mode == "align" and enable_prefix_caching:
        assert num_hit_tokens > 0, "shared prefixes should resume from cached states"
    else:
        assert num_hit_tokens == 0, "a one-block state group never hits"


def run_random_workload(
    harness: MambaHarness,
    rng: random.Random,
    num_steps: int,
    num_bases: int,
    after_step: Callable[[MambaHarness], None] | None = None,
) -> None:
    """Random arrivals over `num_bases` shared 20-token prefixes, rare aborts, one step at a time
    (then `after_step`); at the end no block leaks and every request's tokens are the reference."""
    bases = [[rng.randrange(64) for _ in range(20)] for _ in range(num_bases)]
    prompts: dict[str, list[int]] = {}
    for _ in range(num_steps):
        if rng.random() < 0.3 and len(harness.scheduler.requests) < 16:
            req_id = f"r{len(prompts)}"
            base = rng.choice(bases)[: rng.randrange(0, 20)]
            prompts[req_id] = base + [rng.randrange(64) for _ in range(rng.randrange(1, 10))]
            assert harness.add(req_id, prompts[req_id], max_tokens=rng.randrange(1, 20)) is None
        if rng.random() < 0.02 and harness.scheduler.requests:
            harness.abort([rng.choice(list(harness.scheduler.requests))])
        harness.step()
        if after_step is not None:
            after_step(harness)
    harness.check_no_leaks()
    for req_id, prompt in prompts.items():
        produced = harness.tokens[req_id]
        assert produced == reference_tokens(prompt, len(produced), harness.vocab_size), req_id
