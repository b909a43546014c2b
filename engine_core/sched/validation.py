"""Admission checks of a client's EngineCoreRequest: every rejection names the value and the bound.

It only inspects; it never changes scheduler state.
"""

import math
import re
from array import array

import msgspec

from protocol.bounds import checked_copy
from protocol.buffers import unpack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.sampling import SamplingParams


def validate_request(
    request: EngineCoreRequest,
    max_model_len: int,
    vocab_size: int,
    is_live_req_id: bool,
) -> tuple[array, SamplingParams]:
    """The prompt's token ids and checked sampling parameters, or `ValueError` with the reason."""
    if is_live_req_id:
        raise ValueError(f"duplicate req_id {request.req_id!r}: a live request already has it")
    if not math.isfinite(request.arrival_time):
        # NaN compares neither below nor above anything: it would break the priority heap's order
        raise ValueError(
            f"arrival_time {request.arrival_time} of {request.req_id!r} is not finite: "
            "expected seconds since the epoch"
        )
    prompt = unpack_int32(request.prompt_token_ids)
    if not prompt:
        raise ValueError(f"empty prompt for {request.req_id!r}: expected at least 1 token")
    if len(prompt) > max_model_len:
        raise ValueError(
            f"prompt of {request.req_id!r} has {len(prompt)} tokens: expected at most "
            f"max_model_len={max_model_len}"
        )
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"token id {bad} in the prompt of {request.req_id!r} is out of the vocabulary: "
            f"expected 0 <= id < {vocab_size}"
        )
    # min_tokens > max_tokens cannot reach here: SamplingParams.__post_init__ refuses it on every
    # construction and convert, so _checked_sampling_params reports it as a bad sampling parameter
    params = _checked_sampling_params(request.sampling_params)
    for token_id in params.stop_token_ids:
        if token_id >= vocab_size:
            raise ValueError(
                f"stop token id {token_id} of {request.req_id!r} is out of the vocabulary: "
                f"expected 0 <= id < {vocab_size}"
            )
    return prompt, params


def _checked_sampling_params(params: SamplingParams) -> SamplingParams:
    """A bounds-checked copy; the error names the field, not its array position."""
    try:
        return checked_copy(params)
    except msgspec.ValidationError as exc:
        fields = SamplingParams.__struct_fields__
        reason = re.sub(
            r"`\$\[(\d+)\]", lambda match: f"`{fields[int(match.group(1))]}", str(exc), count=1
        )
        raise ValueError(f"bad sampling parameters: {reason}") from None
