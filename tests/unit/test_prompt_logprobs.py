"""prompt_logprobs through the engine's Scheduler and a checkpoint's ModelRunner: chunked and
asynchronous, every prompt token but the first gets transformers' log_softmax of the logits
before it, the prompt token first, then the top N; a request asking for them computes its whole
prompt rather than reading the prefix cache; the chunk arithmetic and the engine's gathering
hold on their own; a model that cannot score prompt tokens refuses the request at admission.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.workload import Workload, build_rank
from engine_core.core import EngineCore
from engine_core.sched.admission import RequestIntake
from engine_core.sched.prompt_logprobs import PromptLogprobs, num_scored_tokens
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from protocol.config import SchedulerConfig
from protocol.sampling import SamplingParams
from tests.unit.hf_checkpoints import hf_logits, write_checkpoint
from worker.distributed import single_rank_group
from worker.models.registry import prompt_logits_refusal
from worker.sampling.columns import NO_LOGPROBS
from worker.sampling.prompt_logprobs import prompt_logit_rows

CPU = torch.device("cpu")
LOGPROB_TOL = 1e-4  # float32 log_softmax of logits within ~1e-5 of transformers'
SHARED = [17, 40, 33, 91, 5, 66, 12, 8, 150, 77, 23, 54, 9, 31, 200, 42]  # a full block of 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_checkpoint(folder, "llama", seed=3)


def first_outputs(core: EngineCore) -> dict[str, EngineCoreOutput]:
    """Each request's first output (prompt logprobs ride on it), running the core to the end."""
    firsts: dict[str, EngineCoreOutput] = {}
    for _ in range(1000):
        if not core.has_work():
            return firsts
        for outputs in core.step().values():
            for output in outputs.outputs:
                assert output.prompt_logprobs is None or output.req_id not in firsts
                firsts.setdefault(output.req_id, output)
    raise AssertionError("the core did not finish")


def check_against_transformers(
    model: object, prompt: list[int], entries: TokenLogprobs, num_logprobs: int
) -> None:
    assert len(entries.token_ids) == len(prompt) - 1
    logits = hf_logits(model, prompt)  # [P, V]: row t - 1 scores prompt token t
    for token_idx in range(1, len(prompt)):
        reference = torch.log_softmax(logits[token_idx - 1].double(), dim=-1)
        ids = entries.token_ids[token_idx - 1]
        values = entries.logprobs[token_idx - 1]
        assert ids[0] == prompt[token_idx] and len(ids) == 1 + num_logprobs
        assert values == pytest.approx(reference[ids].tolist(), abs=LOGPROB_TOL)
        top = torch.sort(reference, descending=True).values[:num_logprobs]
        assert values[1:] == pytest.approx(top.tolist(), abs=LOGPROB_TOL)
        above = int((reference > reference[prompt[token_idx]] + LOGPROB_TOL).sum())
        assert entries.sampled_token_ranks[token_idx - 1] >= above + 1


def test_chunked_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
    checkpoint: tuple,
) -> None:
    """Chunks of 12 tokens, asynchronous; request 2 shares request 1's first block but asks for
    prompt logprobs, so it reads nothing from the cache, while request 3 (the same prompt, not
    asking) does."""
    folder, model = checkpoint
    prompts = [[*SHARED, 3, 4, 5], [*SHARED, 6, 7, 8, 9, 10], [*SHARED, 6, 7, 8, 9, 10]]
    params = [
        SamplingParams(max_tokens=2, ignore_eos=True),
        SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(max_tokens=2, ignore_eos=True),
    ]
    work = Workload(
        str(folder),
        16,
        64,
        prompts,
        params,
        max_num_batched_tokens=12,
        max_num_seqs=1,  # one at a time: the later ones find the earlier ones' blocks
        check_invariants=True,
        async_scheduling=True,
    )
    core, _ = build_rank(work, single_rank_group(), CPU)
    firsts = first_outputs(core)
    assert firsts["1"].prompt_logprobs is None and firsts["3"].prompt_logprobs is None
    entries = firsts["2"].prompt_logprobs
    assert entries is not None
    check_against_transformers(model, prompts[1], entries, 3)
    assert firsts["2"].num_cached_tokens == 0  # the shared block was computed again
    assert firsts["3"].num_cached_tokens == 16


def test_zero_alternatives_give_the_prompt_tokens_alone_and_a_one_token_prompt_none(
    checkpoint: tuple,
) -> None:
    folder, model = checkpoint
    prompts = [[11, 12, 13, 14, 15, 16, 17], [99]]
    params = [SamplingParams(max_tokens=1, prompt_logprobs=0, ignore_eos=True)] * 2
    core, _ = build_rank(Workload(str(folder), 16, 32, prompts, params), single_rank_group(), CPU)
    firsts = first_outputs(core)
    entries = firsts["1"].prompt_logprobs
    assert entries is not None
    check_against_transformers(model, prompts[0], entries, 0)
    assert firsts["2"].prompt_logprobs == TokenLogprobs([], [], [])


def test_rows_score_each_prompt_token_once_across_chunks() -> None:
    """Request 0 (prompt of 6) in chunks [0, 4) and [4, 7); request 1 asks for none."""
    table = np.array([[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 23, 24, 25, 26, 27]])
    rows = np.array([0, 1])
    asks = np.array([2, NO_LOGPROBS])
    prompt = np.array([6, 8])
    first_chunk = prompt_logit_rows(
        table, rows, asks, prompt, np.array([0, 0]), np.array([4, 8]), np.array([0, 4])
    )
    assert first_chunk is not None
    assert first_chunk.token_idx.tolist() == [0, 1, 2, 3]
    assert first_chunk.target_ids.tolist() == [11, 12, 13, 14]
    assert first_chunk.num_logprobs.tolist() == [2, 2, 2, 2]
    last_chunk = prompt_logit_rows(
        table, rows[:1], asks[:1], prompt[:1], np.array([4]), np.array([2]), np.array([0])
    )
    assert last_chunk is not None and last_chunk.target_ids.tolist() == [15]  # not past it
    decode = prompt_logit_rows(
        table, rows[:1], asks[:1], prompt[:1], np.array([6]), np.array([1]), np.array([0])
    )
    assert decode is None
    assert [num_scored_tokens(first, n, 6) for first, n in ((0, 4), (4, 2), (6, 1))] == [4, 1, 0]


def test_gathered_entries_drop_what_a_recomputed_chunk_repeats() -> None:
    def entries(first_token: int, count: int) -> TokenLogprobs:
        tokens = range(first_token, first_token + count)
        return TokenLogprobs([[t] for t in tokens], [[-float(t)] for t in tokens], [1] * count)

    gathered = PromptLogprobs()
    gathered.add(1, entries(1, 3))
    gathered.add(1, entries(1, 4))  # preempted, then computed again from the start
    assert not gathered.is_complete(6)
    gathered.add(5, entries(5, 1))
    assert gathered.is_complete(6)
    with pytest.raises(ValueError, match="expected at most token 6"):
        gathered.add(8, entries(8, 1))
    taken = gathered.take()
    assert gathered.is_sent and [ids[0] for ids in taken.token_ids] == [1, 2, 3, 4, 5]
    gathered.check_invariants()


def test_a_model_that_cannot_score_prompt_tokens_refuses_them_at_admission() -> None:
    refusal = prompt_logits_refusal("checksum", uses_step_buffers=False)
    assert refusal is not None and prompt_logits_refusal("tiny-llama", False) is None
    assert prompt_logits_refusal("tiny-llama", uses_step_buffers=True) is not None
    intake = RequestIntake(SchedulerConfig(), 64, 512, [], None, None, refusal)
    request = EngineCoreRequest(
        "r", pack_int32([1, 2]), SamplingParams(prompt_logprobs=1), arrival_time=0.0
    )
    with pytest.raises(ValueError, match="prompt_logprobs=1 of 'r' cannot be served"):
        intake.build(request, b"", 0, False)
    plain = EngineCoreRequest("s", pack_int32([1, 2]), SamplingParams(), arrival_time=0.0)
    assert intake.build(plain, b"", 0, False).prompt_logprobs is None
