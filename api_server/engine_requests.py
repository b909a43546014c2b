"""Turning an OpenAI request into EngineCoreRequests (one per choice), with every bound checked
here so that a bad value is a 400 naming its parameter; and the HTTP status of an engine's refusal.
"""

import os
import re
import time
from dataclasses import dataclass

import msgspec

from api_server.errors import ApiError, bad_param, quoted
from api_server.openai_types import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
)
from api_server.tokenizer import ByteTokenizer
from protocol.bounds import checked_copy
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.sampling import SamplingParams

MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32
BUSY_PREFIXES = ("engine busy", "client busy")
# Engine rejections that a client's own values caused (see engine_core/sched/validation.py)
BAD_REQUEST_PATTERN = re.compile(r"prompt|vocabulary|sampling parameters|max_model_len")
PARAM_PATTERN = re.compile(r"`\$\.(?:sampling_params\[(\d+)\]|(\w+))")


@dataclass(slots=True)
class EngineJob:
    """One choice of a response: the request sent to an engine and what routing needs."""

    index: int
    request: EngineCoreRequest
    prompt_token_ids: list[int]
    num_tokens: int  # prompt plus max_tokens: what the router counts as outstanding


def new_response_id(prefix: str) -> str:
    """`prefix-` and 32 random hex digits, as uuid4().hex gives, at a fraction of its cost."""
    return f"{prefix}-{os.urandom(16).hex()}"


def _checked_prompt(prompt: str | list[int], tokenizer: ByteTokenizer, param: str) -> list[int]:
    token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if not token_ids:
        raise bad_param(param, "empty prompt: expected at least one token")
    bad = [token_id for token_id in token_ids if not 0 <= token_id <= MAX_TOKEN_ID]
    if bad:
        raise bad_param(param, f"token id {bad[0]}: expected 0 <= id <= {MAX_TOKEN_ID}")
    return token_ids


def _sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    try:
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            min_tokens=body.min_tokens,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            seed=body.seed,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
        )
    except ValueError as exc:  # __post_init__: min_tokens above max_tokens
        raise bad_param("min_tokens", str(exc)) from None


def _checked(request: EngineCoreRequest) -> EngineCoreRequest:
    """The request with every declared bound checked; a 400 naming the parameter otherwise."""
    try:
        return checked_copy(request)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = PARAM_PATTERN.search(message)
        if match is None:
            raise ApiError(400, f"bad request: {message}") from None
        index, name = match.groups()
        if index is not None:
            param = SamplingParams.__struct_fields__[int(index)]
            value = getattr(request.sampling_params, param)
        else:
            param, value = name, getattr(request, name, None)
        reason = re.sub(r"\s*-\s*at\s*$", "", message[: match.start()]).lower()
        raise ApiError(400, f"{param} {quoted(value)}: {reason}", param=param) from None


def completion_jobs(
    body: CompletionRequest, tokenizer: ByteTokenizer, response_id: str
) -> list[EngineJob]:
    body.check_supported()
    prompts = body.prompts()
    return [
        _job(body, index, _checked_prompt(prompt, tokenizer, "prompt"), response_id)
        for index, prompt in enumerate(prompts)
    ]


def chat_job(body: ChatCompletionRequest, tokenizer: ByteTokenizer, response_id: str) -> EngineJob:
    body.check_supported()
    text = tokenizer.apply_chat_template([(m.role, m.text()) for m in body.messages])
    return _job(body, 0, _checked_prompt(text, tokenizer, "messages"), response_id)


def _job(
    body: CompletionRequest | ChatCompletionRequest,
    index: int,
    prompt_token_ids: list[int],
    response_id: str,
) -> EngineJob:
    params = _sampling_params(body)
    request = EngineCoreRequest(
        req_id=f"{response_id}-{index}",
        prompt_token_ids=pack_int32(prompt_token_ids),
        sampling_params=params,
        arrival_time=time.time(),
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    num_tokens = len(prompt_token_ids) + params.max_tokens
    return EngineJob(index, _checked(request), prompt_token_ids, num_tokens)


def engine_refusal(error: str | None) -> ApiError:
    """The HTTP error of a request the engine ended with an error."""
    message = error or "the engine failed the request without a reason"
    if message.startswith(BUSY_PREFIXES):
        return ApiError(503, message, code="engine_busy")
    if BAD_REQUEST_PATTERN.search(message):
        return ApiError(400, message, param="prompt" if "prompt" in message else None)
    return ApiError(500, message)
