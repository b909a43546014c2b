"""The per-model unit tests' workloads: each model family's prompts, sampling params (and encoder
inputs), their unpaged reference tokens, the Workload that runs them on one rank, and the run
itself (tiny-local's through EngineNullsMirror).
"""

import functools
import random
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from bench.workload import Workload, build_rank, run_to_completion
from engine_core.core import EngineCore
from protocol.kv_cache_spec import NULL_BLOCK_ID
from protocol.sampling import SamplingParams
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from tests.conftest import worker_test_device
from worker.distributed import single_rank_group
from worker.model_runner import ModelRunner, StepTimings
from worker.models.fake.reference import reference_generate
from worker.models.fake.tiny_encdec_reference import TinyEncDecReference

DEVICE = torch.device(worker_test_device())


def make_prompts(seed: int, count: int, shared_len: int, min_suffix: int) -> list[list[int]]:
    """Prompts that mostly share a prefix of up to `shared_len` tokens, so prefix caching hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(shared_len)]
    prompts = []
    for i in range(count):
        head = shared[: rng.randrange(10, shared_len)] if i % 3 else []
        suffix_len = rng.randrange(min_suffix, min_suffix + 21)
        prompts.append(head + [rng.randrange(3, 500) for _ in range(suffix_len)])
    return prompts


def make_encdec_requests(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Six prompts of 6..55 tokens, four sharing a prefix of 33 or more, and encoder inputs of
    3..40 tokens: requests 2 and 3 share theirs (a prefix hit), request 5 has another, and
    request 6 repeats request 2's prompt under request 5's input (it may hit 5's prefix only)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    encoders = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 41))] for _ in range(3)]
    prompts = []
    for i in range(5):
        head = shared[: rng.randrange(33, 41)] if i % 3 else []
        prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(6, 16))])
    prompts.append(prompts[1])
    return prompts, [encoders[2], encoders[0], encoders[0], encoders[2], encoders[1], encoders[1]]


@dataclass(frozen=True)
class Family:
    """One workload: request i has prompts[i], params[i % len(params)] and encoders[i]."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    encoders: list[list[int]] | None = None

    def params_of(self, idx: int) -> SamplingParams:
        return self.params[idx % len(self.params)]


# Prompts of 10..90 tokens, most sharing a 70-token prefix.
PROMPTS = make_prompts(seed=3, count=6, shared_len=70, min_suffix=4)
PARAMS = [
    SamplingParams(max_tokens=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.3, ignore_eos=True),  # unseeded: handle-derived
    SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[5, 77, 301]),
]
# tiny-local: prompts of 5..90 tokens, most sharing up to 65; decodes far past its R-SWA window.
LOCAL = Family(
    make_prompts(seed=5, count=6, shared_len=65, min_suffix=5),
    [
        SamplingParams(max_tokens=90, ignore_eos=True),  # past the R-SWA window: the gap is freed
        SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.3, ignore_eos=True),  # handle-derived
        SamplingParams(max_tokens=50, min_tokens=2, stop_token_ids=[5, 77, 301]),
    ],
)
ENCDEC_PROMPTS, ENCDEC_ENCODERS = make_encdec_requests(seed=3)
ENCDEC = Family(
    ENCDEC_PROMPTS,
    encoders=ENCDEC_ENCODERS,
    params=[
        SamplingParams(max_tokens=14, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True),  # handle-derived
        SamplingParams(max_tokens=12, min_tokens=2, stop_token_ids=[5, 77, 301]),
    ],
)
FAMILIES = {"tiny-local": LOCAL, "tiny-encdec": ENCDEC}
DEFAULT = Family(PROMPTS, PARAMS)


def family(model: str) -> Family:
    return FAMILIES.get(model, DEFAULT)


@functools.cache
def encdec_reference_model() -> TinyEncDecReference:
    return TinyEncDecReference()


@functools.cache
def reference(model: str, idx: int, params_idx: int | None = None) -> list[int]:
    """The unpaged reference's tokens for request idx + 1 of the model's family, under its own
    sampling params or the family's params[params_idx]."""
    work = family(model)
    params = work.params_of(idx) if params_idx is None else work.params[params_idx]
    if work.encoders is not None:
        prompt, encoder = work.prompts[idx], work.encoders[idx]
        return encdec_reference_model().generate(prompt, encoder, params, handle=idx + 1)
    return reference_generate(model, work.prompts[idx], params, handle=idx + 1)


def workload(model: str, block_size: int, num_blocks: int, **options: object) -> Workload:
    """The model's family of requests, every invariant checked each step."""
    work = family(model)
    params = [work.params_of(idx) for idx in range(len(work.prompts))]
    return Workload(
        model,
        block_size,
        num_blocks,
        work.prompts,
        params,
        check_invariants=True,
        encoder_prompts=work.encoders,
        **options,  # type: ignore[arg-type]
    )


def step_collecting_tokens(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    """One engine step; each request's new tokens are appended to tokens[req_id]."""
    for client_outputs in core.step().values():
        for output in client_outputs.outputs:
            tokens[output.req_id].extend(output.new_token_ids)


def first_step_tokens(core: EngineCore, req_id: str = "1") -> list[int]:
    """The engine's first step (every prefill that fits, each with its first token): the tokens
    it gave req_id."""
    tokens: defaultdict[str, list[int]] = defaultdict(list)
    step_collecting_tokens(core, tokens)
    return tokens[req_id]


def assert_matches_reference(model: str, outputs: dict[int, list[int]]) -> None:
    for idx in range(len(family(model).prompts)):
        assert outputs[idx + 1] == reference(model, idx), f"request {idx + 1}"


class EngineNullsMirror:
    """Runs each step on the ModelRunner after nulling the table entries the engine has freed.

    The engine never tells the workers which blocks it freed (vLLM does not either): their tables
    keep the old ids, whose pages may already serve another request. Nulling them here turns a
    read of a freed position (an earlier chunk, the R-SWA gap) into the runner's "maps to the
    null block" error instead of a stale page read by luck.
    """

    CHUNKED_GROUP = 1  # tiny-local's chunked-local group

    def __init__(self, core: EngineCore, runner: ModelRunner) -> None:
        self.core = core
        self.runner = runner
        self.num_nulled = [0] * len(runner.kv_cache_config.kv_cache_groups)  # per group, summed
        self.resumed_prompts: dict[int, int] = {}  # handle -> worker prompt length when resumed
        self.num_null_hits = 0  # null blocks in new requests' chunked-local tables (prefix hits)

    @property
    def timings(self) -> StepTimings:
        return self.runner.timings

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._mirror_nulls()
        for new in scheduler_output.scheduled_new_reqs:
            self.num_null_hits += new.block_ids[self.CHUNKED_GROUP].count(NULL_BLOCK_ID)
        output = self.runner.execute_model(scheduler_output)
        batch = self.runner.input_batch
        for handle in scheduler_output.scheduled_cached_reqs.resumed_handles:
            self.resumed_prompts[handle] = int(batch.num_prompt_tokens[batch.handle_to_row[handle]])
        return output

    def _mirror_nulls(self) -> None:
        scheduler = self.core.scheduler
        batch = self.runner.input_batch
        for request in scheduler.running:
            row = batch.handle_to_row.get(request.handle)
            if row is None:
                continue  # new or resumed this step: the engine sends its whole table
            engine_ids = scheduler.kv_cache_manager.get_block_ids(request.req_id)
            for group_idx, ids in enumerate(engine_ids):
                table = batch.block_table[group_idx]
                num_held = int(table.num_blocks_per_row[row])
                freed = np.array(ids[:num_held]) == NULL_BLOCK_ID
                freed &= table.block_table[row, :num_held] != NULL_BLOCK_ID
                table.block_table[row, :num_held][freed] = NULL_BLOCK_ID
                self.num_nulled[group_idx] += int(freed.sum())


def build_mirrored(work: Workload) -> tuple[EngineCore, EngineNullsMirror]:
    core, executor = build_rank(work, single_rank_group(), DEVICE)
    mirror = EngineNullsMirror(core, executor.runner)
    executor.runner = mirror  # type: ignore[assignment]  # the TimedRunner calls it as the runner
    return core, mirror


@dataclass
class Run:
    outputs: dict[int, list[int]]  # request handle -> generated tokens
    num_preemptions: int
    num_hit_tokens: int  # prompt tokens served from the prefix cache
    mirror: EngineNullsMirror | None  # tiny-local's runs only


def run(work: Workload) -> Run:
    """Every request to completion on one rank, then the runner's invariants; tiny-local runs
    through EngineNullsMirror, so a read of a freed position fails."""
    if work.model == "tiny-local":
        core, mirror = build_mirrored(work)
        runner = mirror.runner
    else:
        core, executor = build_rank(work, single_rank_group(), DEVICE)
        mirror, runner = None, executor.runner
    outputs = run_to_completion(core)
    runner.check_invariants()
    stats = core.get_stats()
    num_preemptions, num_hit_tokens = stats["num_preemptions"], stats["prefix_cache_hits"]
    return Run(outputs, int(num_preemptions), int(num_hit_tokens), mirror)
