"""Asynchronous scheduling through the real service: the engine sends step N+1 while the ranks
run step N, and every client still gets exactly the synchronous loop's tokens (the unpaged
reference), at TP=1 and TP=2, with prefix caching on and off, under forced preemption and with
aborts mid-stream; nothing is left behind. Logprobs travel with their tokens.
"""

import random

import pytest
import torch

from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams
from tests.integration.conftest import Processes, stop_launch, wait_engine_serving, wait_for
from tests.integration.served_requests import launch_checked
from worker.models.fake.reference import ReferenceModel, reference_generate

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 96
NUM_REQUESTS = 24


def _workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    workload = []
    for idx in range(NUM_REQUESTS):
        prompt = shared[: rng.randrange(0, 40)] + [rng.randrange(3, 500) for _ in range(9)]
        max_tokens = rng.randrange(1, 40)
        match idx % 3:
            case 0:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            case 1:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=idx)
            case _:
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[5, 9, 17])
        workload.append((prompt, params))
    return workload


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tp_size", "model", "caching", "num_gpu_blocks"),
    [
        (2, "tiny-llama-hybrid", "--enable-prefix-caching", 56),
        (1, "checksum", "--no-enable-prefix-caching", 12),
    ],
    ids=["tp2-hybrid-cached", "tp1-checksum-uncached"],
)
def test_async_scheduling_serves_the_synchronous_tokens(
    processes: Processes,
    addresses: dict,
    tp_size: int,
    model: str,
    caching: str,
    num_gpu_blocks: int,
) -> None:
    launch_checked(
        processes,
        addresses,
        tp_size,
        model,
        caching,
        4 if model == "tiny-llama-hybrid" else 16,
        MAX_MODEL_LEN,
        "--async-scheduling",
        max_num_batched_tokens=64,
        num_gpu_blocks=num_gpu_blocks,  # small: requests preempt each other
    )
    workload = _workload(tp_size)
    req_ids = [f"r{idx}" for idx in range(NUM_REQUESTS)]
    aborted = {"r4", "r11", "r19"}
    with EngineClient(addresses["client"], 120.0) as client:
        wait_engine_serving(processes, client, 120.0)
        for req_id, (prompt, params) in zip(req_ids, workload, strict=True):
            client.add_request(make_request(req_id, prompt, params))
        wait_for(
            lambda: any(client.result(r).token_ids for r in aborted) or client.poll_outputs(0.05),
            60,
            "the first tokens",
        )
        client.abort(sorted(aborted))
        results = client.run_until_finished(req_ids, 240)
        stats = client.get_stats()
    assert stats["num_preemptions"] > 0, "the small pool should force preemption"
    for idx, (req_id, (prompt, params)) in enumerate(zip(req_ids, workload, strict=True)):
        expected = reference_generate(
            model, prompt, params, max_model_len=MAX_MODEL_LEN, handle=idx + 1
        )
        result = results[req_id]
        assert result.error is None, f"{req_id}: {result.error}"
        if req_id in aborted and result.finish_reason == "abort":
            assert result.token_ids == expected[: len(result.token_ids)], req_id
        else:
            assert result.token_ids == expected, req_id
    stop_launch(processes)


LOGPROB_PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.9, seed=3, top_p=0.9, top_k=40, logprobs=3),
    SamplingParams(max_tokens=10, repetition_penalty=1.4, stop_token_ids=[5, 9, 17], logprobs=0),
    SamplingParams(max_tokens=9, temperature=1.2, seed=8, presence_penalty=1.0, min_tokens=2),
    SamplingParams(max_tokens=11, temperature=0.7, seed=1, min_p=0.1, logprobs=20),
]


@pytest.mark.timeout(300)
def test_logprobs_travel_with_their_tokens_from_tp2_ranks(
    processes: Processes, addresses: dict
) -> None:
    """Filters, penalties and logprobs through the real service: TP=2 ranks over the shared-
    memory ring, asynchronous steps, preemption; each client output's logprobs are the raw
    log_softmax at that token, and the tokens are the reference's."""
    launch_checked(
        processes,
        addresses,
        2,
        "tiny-llama",
        "--enable-prefix-caching",  # the default
        16,
        MAX_MODEL_LEN,
        "--async-scheduling",
        max_num_batched_tokens=64,
        num_gpu_blocks=12,
    )
    workload = [(prompt, LOGPROB_PARAMS[idx % 4]) for idx, (prompt, _) in enumerate(_workload(5))]
    req_ids = [f"r{idx}" for idx in range(NUM_REQUESTS)]
    entries: dict[str, list] = {req_id: [] for req_id in req_ids}
    with EngineClient(addresses["client"], 120.0) as client:
        wait_engine_serving(processes, client, 120.0)
        for req_id, (prompt, params) in zip(req_ids, workload, strict=True):
            client.add_request(make_request(req_id, prompt, params))

        def finished() -> bool:
            for output in client.poll_outputs(0.05):
                if output.new_logprobs is not None:
                    entries[output.req_id].append(output.new_logprobs)
            return all(client.result(req_id).is_finished for req_id in req_ids)

        wait_for(finished, 240, "every request's last output")
        stats = client.get_stats()
        results = {req_id: client.result(req_id) for req_id in req_ids}
    assert stats["num_preemptions"] > 0, "the small pool should force preemption"
    model = ReferenceModel("tiny-llama")
    for idx, (req_id, (prompt, params)) in enumerate(zip(req_ids, workload, strict=True)):
        tokens = results[req_id].token_ids
        expected = model.generate(prompt, params, max_model_len=MAX_MODEL_LEN, handle=idx + 1)
        assert tokens == expected, req_id
        if params.logprobs is None:
            assert not entries[req_id], req_id
            continue
        assert len(entries[req_id]) == len(tokens), req_id
        for pos, (token_id, entry) in enumerate(zip(tokens, entries[req_id], strict=True)):
            logits = model.next_token_logits(prompt + tokens[:pos], len(prompt))
            reference = torch.log_softmax(logits, dim=-1)
            ((ids,), (values,), (rank,)) = (
                entry.token_ids,
                entry.logprobs,
                entry.sampled_token_ranks,
            )
            assert ids[0] == token_id and len(ids) == 1 + params.logprobs, req_id
            assert values == pytest.approx(reference[ids].tolist(), rel=1e-6, abs=1e-6)
            assert rank == int((reference > reference[token_id]).sum()) + 1
    stop_launch(processes)
