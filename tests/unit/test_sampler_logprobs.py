"""Logprobs: the raw distribution's log_softmax, the sampled id's rank, and the top N per token."""

import numpy as np
import pytest
import torch

from protocol.buffers import pack_int32, unpack_float32, unpack_int32
from protocol.sampling import SamplingParams
from protocol.worker_messages import NewRequestData
from tests.unit.test_model_runner import cached, make_runner, step
from worker.models.fake.reference import ReferenceModel, reference_generate
from worker.sampling.columns import NO_LOGPROBS
from worker.sampling.logprobs import LogprobColumns, compute_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _unpack(columns: LogprobColumns, counts: list[int]) -> list[tuple[list[int], list, int]]:
    """(ids, logprobs, rank) per entry, cut by each entry's count of alternatives."""
    values, ids = unpack_float32(columns.logprobs).tolist(), unpack_int32(columns.token_ids)
    ranks = unpack_int32(columns.sampled_token_ranks).tolist()
    entries, start = [], 0
    for idx, count in enumerate(counts):
        entries.append(
            (ids[start : start + 1 + count].tolist(), values[start : start + 1 + count], ranks[idx])
        )
        start += 1 + count
    assert start == len(values) == len(ids) and len(ranks) == len(counts)
    return entries


def test_logprobs_are_the_raw_log_softmax_with_the_rank_and_top_n() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn((5, 40), generator=generator, dtype=torch.float64) * 3
    tokens = torch.tensor([3, 7, 0, 39, 12])
    num_logprobs = np.array([NO_LOGPROBS, 0, 3, 20, 2])
    columns = compute_logprobs(logits, tokens, num_logprobs)
    reference = torch.log_softmax(logits, dim=-1)
    asked = [1, 2, 3, 4]
    entries = _unpack(columns, [int(num_logprobs[row]) for row in asked])
    for row, (ids, values, rank) in zip(asked, entries, strict=True):
        token_id = int(tokens[row])
        order = torch.argsort(reference[row], descending=True).tolist()
        assert ids == [token_id, *order[: num_logprobs[row]]]
        assert values == pytest.approx(reference[row, ids].tolist(), rel=1e-6)
        assert rank == order.index(token_id) + 1
    assert compute_logprobs(logits, tokens, np.full(5, NO_LOGPROBS)) == LogprobColumns()


def test_a_greedy_token_tied_at_the_top_has_rank_1() -> None:
    logits = torch.tensor([[2.0, 2.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    columns = compute_logprobs(logits, torch.tensor([0, 2]), np.array([1, 0]))
    assert unpack_int32(columns.sampled_token_ranks).tolist() == [1, 1]


def test_the_runner_returns_raw_logprobs_of_penalized_seeded_draws() -> None:
    """Penalties and temperature pick the token; its logprobs stay the model's own."""
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(
        max_tokens=4, temperature=0.8, seed=3, repetition_penalty=1.5, top_k=40, logprobs=3
    )
    expected = reference_generate("checksum", prompt, params)
    model = ReferenceModel("checksum")
    runner = make_runner()
    sequence = list(prompt)
    first = NewRequestData(1, pack_int32(prompt), params, ([1, 2],), 0)
    steps = [step(1, [6], new=[first]), step(2, [1], cached_reqs=cached([(1, [], None, 6)]))]
    steps.append(step(3, [1], cached_reqs=cached([(1, [], [3], 7)])))
    for scheduler_output in steps:
        output = runner.execute_model(scheduler_output)
        token_id = unpack_int32(output.sampled_token_ids)[0]
        reference = torch.log_softmax(model.next_token_logits(sequence, len(prompt)), dim=-1)
        ((ids, values, rank),) = _unpack(
            LogprobColumns(output.logprobs, output.logprob_token_ids, output.sampled_token_ranks),
            [3],
        )
        order = torch.argsort(reference, descending=True).tolist()
        assert ids == [token_id, *order[:3]]
        assert values == pytest.approx(reference[ids].tolist(), rel=1e-6)
        assert rank == order.index(token_id) + 1
        sequence.append(token_id)
    assert sequence[len(prompt) :] == expected[:3]
