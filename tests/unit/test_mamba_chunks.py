"""Block-aligned chunked prefill for align-mode Mamba groups: BlockAlignedChunks' arithmetic, then
whole Scheduler steps over full attention beside a Mamba group (chunk sizes, hits, no lookahead)."""

from types import SimpleNamespace

import pytest

from engine_core.sched.block_aligned_chunks import BlockAlignedChunks
from engine_core.sched.scheduler import Scheduler
from protocol.buffers import pack_int32, unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.config import CacheConfig, SchedulerConfig
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelInfo, ModelRunnerOutput

BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=4, dtype="float32")


def _mamba(mode: str) -> MambaSpec:
    return MambaSpec(BLOCK_SIZE, ((2, 3),), "float32", mamba_cache_mode=mode)


def _request(num_prompt_tokens: int, num_tokens: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        num_prompt_tokens=num_prompt_tokens, num_tokens=num_tokens or num_prompt_tokens
    )


# (prompt, tokens known, computed, offered) -> scheduled; block 4, at most 6 tokens a chunk
@pytest.mark.parametrize(
    ("num_prompt_tokens", "num_tokens", "num_computed", "num_offered", "num_scheduled"),
    [
        (20, 20, 0, 6, 4),  # a middle chunk ends on the boundary below its end
        (20, 20, 0, 3, 0),  # not a block's worth: nothing this step
        (10, 10, 0, 10, 8),  # the last chunk stops at 8, the farthest an identical prompt hits
        (8, 8, 0, 8, 4),  # hits stop at 7: the checkpoint at 4 is the one a twin can use
        (10, 10, 8, 2, 2),  # the prompt's tail ends mid-block
        (10, 10, 4, 6, 4),
        (10, 11, 11, 1, 1),  # decode passes unchanged
        (6, 11, 0, 11, 8),  # a resumed request recomputes its generated tokens the same way
    ],
)
def test_chunks_end_on_block_boundaries_except_the_last(
    num_prompt_tokens: int,
    num_tokens: int,
    num_computed: int,
    num_offered: int,
    num_scheduled: int,
) -> None:
    chunks = BlockAlignedChunks(BLOCK_SIZE, max_chunk_tokens=6)
    request = _request(num_prompt_tokens, num_tokens)
    assert chunks.clip(request, num_computed, num_offered) == num_scheduled


def test_a_block_wider_than_any_chunk_is_crossed_in_pieces_that_meet_its_boundary() -> None:
    chunks = BlockAlignedChunks(block_size=8, max_chunk_tokens=6)
    request = _request(40)
    assert chunks.clip(request, 0, 6) == 6
    assert chunks.clip(request, 6, 6) == 2  # started mid-block: stops at the boundary at 8
    assert chunks.clip(request, 8, 6) == 6


def test_only_an_align_mode_group_with_a_prefix_cache_and_chunking_clips() -> None:
    def make(
        spec: MambaSpec, caching: bool, chunked: bool = True, max_batched: int = 64
    ) -> BlockAlignedChunks | None:
        groups = [KVCacheGroupSpec(["full.0"], FULL), KVCacheGroupSpec(["mamba.0"], spec)]
        return BlockAlignedChunks.for_configs(
            KVCacheConfig(16, groups),
            CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
            SchedulerConfig(
                enable_chunked_prefill=chunked,
                long_prefill_token_threshold=12,
                max_num_batched_tokens=max_batched,
            ),
        )

    assert make(_mamba("align"), caching=True) == BlockAlignedChunks(BLOCK_SIZE, 12)
    assert make(_mamba("align"), caching=True, max_batched=8) == BlockAlignedChunks(BLOCK_SIZE, 8)
    assert make(_mamba("align"), caching=False) is None
    assert make(_mamba("align"), caching=True, chunked=False) is None
    assert make(_mamba("none"), caching=True) is None


class _Driver:
    """A Scheduler over full attention and one Mamba group, stepped with a constant sample."""

    def __init__(self, mode: str, caching: bool = True, **scheduler_fields: object) -> None:
        groups = [KVCacheGroupSpec(["full.0"], FULL), KVCacheGroupSpec(["mamba.0"], _mamba(mode))]
        scheduler_fields.setdefault("async_scheduling", False)
        self.scheduler = Scheduler(
            SchedulerConfig(**scheduler_fields),
            CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
            KVCacheConfig(32, groups),
            ModelInfo("fake-mamba", 64, [], 64, groups),
        )

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = EngineCoreRequest(req_id, pack_int32(prompt), params, 0.0, 0)
        assert self.scheduler.add_request(request, b"") is None

    def step(self) -> list[int]:
        """Run one step; the tokens scheduled per request, in SchedulerOutput order."""
        out = self.scheduler.schedule()
        handles = [new.handle for new in out.scheduled_new_reqs]
        handles += unpack_int32(out.scheduled_cached_reqs.handles)
        sampled = pack_int32([7] * len(handles))
        self.scheduler.update_from_output(
            out, ModelRunnerOutput(out.step_id, 0, pack_int32(handles), sampled)
        )
        self.scheduler.check_invariants()
        return list(unpack_int32(out.num_scheduled_tokens))


PROMPT = list(range(1, 11))  # 10 tokens


def test_a_prompt_is_split_at_its_last_block_boundary() -> None:
    driver = _Driver("align")
    driver.add("a", PROMPT)
    assert [driver.step() for _ in range(3)] == [[8], [2], [1]]


def test_middle_chunks_end_on_block_boundaries_under_a_small_budget() -> None:
    driver = _Driver("align", max_num_batched_tokens=6)
    driver.add("a", PROMPT)
    assert [driver.step() for _ in range(3)] == [[4], [4], [2]]


def test_without_align_mode_or_a_prefix_cache_the_prompt_is_one_chunk() -> None:
    for driver in (_Driver("none"), _Driver("align", caching=False)):
        driver.add("a", PROMPT)
        assert driver.step() == [10]


def test_a_twin_waits_for_the_step_that_writes_its_checkpoint_then_hits_it() -> None:
    driver = _Driver("align")
    driver.add("a", PROMPT, max_tokens=3)
    driver.add("b", [*PROMPT, 11])
    assert driver.step() == [8]  # b would read the checkpoint at 8 before a writes it
    assert driver.step() == [3, 2]  # b (new) resumes from 8; a finishes its prompt
    b = driver.scheduler.requests["b"]
    assert b.num_cached_tokens == 8


def test_admission_reserves_no_lookahead_beside_an_align_mode_group() -> None:
    """Reserving the rest of the prompt would give the Mamba group slots past the chunk, where
    its new state block would land at the wrong position."""
    driver = _Driver("align", max_num_batched_tokens=6, reserve_full_prompt=True)
    driver.add("a", [*PROMPT, *PROMPT])
    assert driver.step() == [4]
    kv = driver.scheduler.kv_cache_manager
    assert [len(ids) for ids in kv.get_block_ids("a")] == [1, 1]


def test_a_chunk_stops_at_the_last_boundary_before_the_shared_prefix_junction() -> None:
    """Full attention hit 10 tokens of a shared prefix and the Mamba group only 4: the chunk
    from 4 ends at 8, so the state there is written and the next request sharing the prefix
    resumes from it (the reference's scheduler stops there too). Without the junction the
    chunk runs to the last boundary, 28, and no state at the shared prefix is ever kept."""
    chunks = BlockAlignedChunks(BLOCK_SIZE, max_chunk_tokens=64)
    request = _request(30)
    assert chunks.clip(request, 4, 26) == 24
    assert chunks.clip(request, 4, 26, shared_prefix_boundary=10) == 4
    assert chunks.clip(request, 4, 26, shared_prefix_boundary=6) == 24  # no boundary inside
    assert chunks.clip(request, 8, 22, shared_prefix_boundary=10) == 20  # already past it


def test_the_scheduler_ends_a_chunk_on_the_junction_so_a_third_request_hits_it() -> None:
    """a caches every full-attention block of its prompt but a state only at 12, past the
    10-token prefix it shares with b and c. b's full attention hits 8 tokens and its Mamba group
    none: b's first chunk ends at that junction, 8, so the state there is kept and c resumes
    from it. Without the stop b would run to 12 and c would hit nothing."""
    driver = _Driver("align")
    shared = list(range(1, 11))

    def run_to_end() -> None:
        while driver.scheduler.has_unfinished_requests():
            driver.step()

    driver.add("a", [*shared, *range(20, 26)])
    run_to_end()
    driver.add("b", [*shared, *range(30, 36)])
    assert driver.step() == [8]
    run_to_end()
    driver.add("c", [*shared, *range(40, 46)])
    driver.step()
    assert driver.scheduler.requests["c"].num_cached_tokens == 8
