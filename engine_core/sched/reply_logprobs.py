"""Reply logprobs: a step reply's logprob columns cut into each request's TokenLogprobs.

The ranks send one entry per request that samples in the step and asked for logprobs, in the
step's order (ModelRunnerOutput); the engine reads rank 0's, after the ranks' sampled ids agree.
It only reads: the Scheduler sends them out with their tokens.
"""

from array import array
from collections.abc import Sequence

from engine_core.sched.request import Request
from protocol.buffers import unpack_float32, unpack_int32
from protocol.client_messages import TokenLogprobs
from protocol.worker_messages import ModelRunnerOutput


def read_reply_logprobs(
    output: ModelRunnerOutput,
    requests: Sequence[Request],
    is_sampling: Sequence[bool],
    sampled: array,
) -> list[TokenLogprobs | None]:
    """Each request's logprobs of its sampled token, aligned with `requests`; None for one
    that did not sample or asked for none. Raises ValueError unless the columns hold exactly
    those entries, each led by the sampled id."""
    values, token_ids = unpack_float32(output.logprobs), unpack_int32(output.logprob_token_ids)
    ranks = unpack_int32(output.sampled_token_ranks)
    if len(values) != len(token_ids):
        raise ValueError(
            f"rank {output.rank} sent {len(values)} logprobs and {len(token_ids)} logprob token "
            f"ids for step {output.step_id}: expected as many of each"
        )
    per_request: list[TokenLogprobs | None] = [None] * len(requests)
    start = num_entries = 0
    for idx, (request, samples) in enumerate(zip(requests, is_sampling, strict=True)):
        num_logprobs = request.sampling_params.logprobs
        if not samples or num_logprobs is None:
            continue
        end = start + 1 + num_logprobs
        if num_entries >= len(ranks) or end > len(values) or token_ids[start] != sampled[idx]:
            raise ValueError(
                f"rank {output.rank} sent logprobs for step {output.step_id} that do not match "
                f"its sampled tokens: entry {num_entries} (request {request.handle}, "
                f"{num_logprobs} alternatives) is missing or leads with another id"
            )
        per_request[idx] = TokenLogprobs(
            [token_ids[start:end].tolist()], [values[start:end].tolist()], [ranks[num_entries]]
        )
        start, num_entries = end, num_entries + 1
    if num_entries != len(ranks) or start != len(values):
        raise ValueError(
            f"rank {output.rank} sent {len(ranks)} logprob entries ({len(values)} values) for "
            f"step {output.step_id}: expected {num_entries} ({start} values)"
        )
    return per_request
