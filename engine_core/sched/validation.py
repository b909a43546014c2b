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
from protocol.kv_cache_spec import CrossAttentionSpec, KVCacheGroupSpec
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
    _check_sampling_ids(params, request.req_id, vocab_size)
    return prompt, params


def _check_sampling_ids(params: SamplingParams, req_id: str, vocab_size: int) -> None:
    """ValueError naming the field and the first of its token ids past the vocabulary (the
    declared bounds already refuse negative ones)."""
    fields: list[tuple[str, list[int]]] = [
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("bad_words", [token_id for word in params.bad_words_token_ids or [] for token_id in word]),
    ]
    for name, token_ids in fields:
        for token_id in token_ids:
            if token_id >= vocab_size:
                raise ValueError(
                    f"{name} token id {token_id} of {req_id!r} is out of the vocabulary: "
                    f"expected 0 <= id < {vocab_size}"
                )


def max_num_encoder_tokens(kv_cache_groups: list[KVCacheGroupSpec]) -> int | None:
    """The longest encoder input the model's cross-attention groups take; None without one."""
    limits = [
        group.spec.max_num_encoder_tokens
        for group in kv_cache_groups
        if isinstance(group.spec, CrossAttentionSpec)
    ]
    return min(limits) if limits else None


def validate_encoder_tokens(
    request: EngineCoreRequest, max_num_encoder_tokens: int | None, vocab_size: int
) -> array | None:
    """The encoder input's token ids (None for a decoder-only model), or `ValueError`.

    Args:
        max_num_encoder_tokens: the model's longest encoder input; None when the model has no
            cross-attention group, and then a request must bring no encoder input.
    """
    if max_num_encoder_tokens is None:
        if request.encoder_token_ids is not None:
            raise ValueError(
                f"{request.req_id!r} brings encoder_token_ids, but the model has no "
                "cross-attention layers: expected none"
            )
        return None
    if request.encoder_token_ids is None:
        raise ValueError(
            f"{request.req_id!r} brings no encoder_token_ids: the encoder-decoder model expects "
            f"1 to {max_num_encoder_tokens} encoder tokens"
        )
    encoder = unpack_int32(request.encoder_token_ids)
    if not 1 <= len(encoder) <= max_num_encoder_tokens:
        raise ValueError(
            f"encoder input of {request.req_id!r} has {len(encoder)} tokens: expected 1 to "
            f"max_num_encoder_tokens={max_num_encoder_tokens}"
        )
    low, high = min(encoder), max(encoder)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"token id {bad} in the encoder input of {request.req_id!r} is out of the "
            f"vocabulary: expected 0 <= id < {vocab_size}"
        )
    return encoder


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
