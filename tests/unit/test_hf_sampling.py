"""Sampling from a real checkpoint (float32 logits) through the engine's Scheduler and ModelRunner:
repetition penalty as transformers' own processor applies it, logprobs equal to transformers'
log_softmax, and TP=2 ranks (threads) that agree on every seeded, filtered, penalized draw.

Float comparisons stop at a near-tie, as test_hf_generate.py's do: our logits differ from
transformers' by about 1e-5, so where two choices are closer than MARGIN_TOL either may win.
"""

from pathlib import Path

import pytest
import torch
import transformers

from bench.workload import Workload, build_rank
from engine_core.core import EngineCore
from protocol.client_messages import TokenLogprobs
from protocol.sampling import SamplingParams
from tests.unit.hf_checkpoints import hf_logits, write_checkpoint
from tests.unit.test_hf_generate import make_prompts
from tests.unit.thread_tp_group import run_ranks
from worker.distributed import TPGroup, single_rank_group

CPU = torch.device("cpu")
MARGIN_TOL = 1e-3
LOGPROB_TOL = 1e-4  # float32 log_softmax of logits within ~1e-5 of transformers'
MAX_TOKENS = 8
PROMPTS = make_prompts(seed=9, count=4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, write_checkpoint(folder, "llama", seed=3)


def serve(
    folder: Path,
    params: list[SamplingParams],
    group: TPGroup,
    prompts: list[list[int]] = PROMPTS,
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    """Each prompt with its params, chunked and asynchronous: tokens and logprobs by req_id."""
    work = Workload(
        str(folder),
        4,
        200,
        prompts,
        params,
        max_num_batched_tokens=12,
        check_invariants=True,
        async_scheduling=True,
    )
    core, _ = build_rank(work, group, CPU)
    return _run(core)


def _run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    for _ in range(1000):
        if not core.has_work():
            break
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
                if output.new_logprobs is not None:
                    logprobs.setdefault(output.req_id, []).append(output.new_logprobs)
    return tokens, logprobs


def test_greedy_repetition_penalty_equals_transformers_processor(checkpoint: tuple) -> None:
    folder, model = checkpoint
    penalty = 1.3
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=penalty)
    served, _ = serve(folder, [params] * len(PROMPTS), single_rank_group())
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    num_compared = 0
    for idx, prompt in enumerate(PROMPTS):
        sequence = list(prompt)
        for step_idx, token_id in enumerate(served[str(idx + 1)]):
            scores = processor(torch.tensor([sequence]), hf_logits(model, sequence)[-1:].clone())
            top2 = scores[0].topk(2)
            expected = int(top2.indices[0])
            if token_id != expected:
                margin = float(top2.values[0] - top2.values[1])
                assert margin < MARGIN_TOL, f"request {idx + 1} step {step_idx}: {margin:.3g}"
                break
            sequence.append(token_id)
            num_compared += 1
    assert num_compared >= len(PROMPTS) * MAX_TOKENS - 2, "near-ties should be rare"
    penalized = [served[str(idx + 1)] for idx in range(len(PROMPTS))]
    plain, _ = serve(
        folder, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * 4, single_rank_group()
    )
    assert penalized != [plain[str(idx + 1)] for idx in range(len(PROMPTS))], "no effect"


FEATURES = [
    SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=4, top_p=0.9, ignore_eos=True, logprobs=5
    ),
    SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.7, ignore_eos=True, logprobs=0),
    SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=1.3,
        seed=8,
        top_k=12,
        min_p=0.05,
        frequency_penalty=0.4,
        ignore_eos=True,
        logprobs=3,
    ),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=2, min_tokens=4),
]


def test_logprobs_are_transformers_log_softmax_at_every_served_token(checkpoint: tuple) -> None:
    folder, model = checkpoint
    tokens, logprobs = serve(folder, FEATURES, single_rank_group())
    assert set(logprobs) == {"1", "2", "3"}
    for idx, prompt in enumerate(PROMPTS):
        req_id, params = str(idx + 1), FEATURES[idx]
        served = tokens[req_id]
        if params.logprobs is None:
            continue
        assert len(logprobs[req_id]) == len(served) == MAX_TOKENS
        for step_idx, (token_id, entry) in enumerate(zip(served, logprobs[req_id], strict=True)):
            logits = hf_logits(model, list(prompt) + served[:step_idx])[-1]
            reference = torch.log_softmax(logits.double(), dim=-1)
            ((ids,), (values,), (rank,)) = (
                entry.token_ids,
                entry.logprobs,
                entry.sampled_token_ranks,
            )
            assert ids[0] == token_id and len(ids) == 1 + params.logprobs
            assert values == pytest.approx(reference[ids].tolist(), abs=LOGPROB_TOL)
            top = torch.sort(reference, descending=True).values[: params.logprobs]
            assert values[1:] == pytest.approx(top.tolist(), abs=LOGPROB_TOL)
            near = (reference - reference[token_id]).abs() < LOGPROB_TOL  # ties either way
            above = int((reference > reference[token_id]).sum())
            assert above + 1 - int(near.sum()) < rank <= above + int(near.sum()), step_idx


def test_tp2_ranks_agree_on_seeded_filtered_penalized_draws(checkpoint: tuple) -> None:
    """The all-reduce leaves both ranks the same logits bytes: the same draws, and the same
    logprobs (the engine reads rank 0's)."""
    folder, _ = checkpoint
    rank0, rank1 = run_ranks(2, lambda group: serve(folder, FEATURES, group))
    assert rank0 == rank1
    assert all(len(tokens) == MAX_TOKENS for tokens in rank0[0].values())


def test_two_eos_ids_of_a_checkpoint_stop_it_unless_min_tokens_holds_them_back(
    checkpoint: tuple, tmp_path: Path
) -> None:
    """A checkpoint listing two EOS ids (as Llama 3's generation_config.json does): either
    stops a request; under min_tokens the ranks never sample them, as transformers'
    MinNewTokensLengthLogitsProcessor, and the request runs on."""
    folder, model = checkpoint
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = serve(folder, [greedy] * len(PROMPTS), single_rank_group())
    first, second = plain["1"][0], plain["2"][1]
    assert first != second and first not in plain["2"][:2]
    write_checkpoint(tmp_path, "llama", seed=3, eos_token_id=[second, first])  # same weights
    stops = SamplingParams(max_tokens=MAX_TOKENS)
    held = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=3)
    prompts = [PROMPTS[0], PROMPTS[1]] * 2
    tokens, _ = serve(tmp_path, [stops, stops, held, held], single_rank_group(), prompts)
    assert tokens["1"] == [first] and tokens["2"] == plain["2"][:2]
    processor = transformers.MinNewTokensLengthLogitsProcessor(0, 3, [first, second])
    for idx in (2, 3):  # the prompts whose greedy tokens were EOS ids: now they are not
        prompt, served = prompts[idx], tokens[str(idx + 1)]
        assert len(served) >= 3 and not {first, second} & set(served[:3])
        sequence = list(prompt)
        for token_id in served[:3]:
            processor.prompt_length_to_skip = len(prompt)
            scores = processor(torch.tensor([sequence]), hf_logits(model, sequence)[-1:].clone())
            top2 = scores[0].topk(2)
            if token_id != int(top2.indices[0]):
                assert float(top2.values[0] - top2.values[1]) < MARGIN_TOL
                break
            sequence.append(token_id)
