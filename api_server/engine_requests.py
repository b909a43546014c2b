"""Turning an OpenAI request into EngineCoreRequests (one per choice), with every bound checked
here so that a bad value is a 400 naming its parameter, a prompt that cannot fit the engines'
max_model_len included (it never reaches an engine); and the HTTP status of an engine's refusal.
"""

import os
import re
import time
from dataclasses import dataclass, field

import msgspec

from api_server.chat_template import COMPILE_ERROR, ChatTemplateError
from api_server.errors import ApiError, bad_param, quoted
from api_server.openai_types import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JsonValue,
)
from api_server.tokenizer import PromptTokenizer
from protocol.bounds import checked_copy
from protocol.buffers import pack_int32
from protocol.client_messages import EngineCoreRequest
from protocol.sampling import MAX_TOKENS_LIMIT, SamplingParams

MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32
BUSY_PREFIXES = ("engine busy", "client busy")
# Engine rejections that a client's own values caused (see engine_core/sched/validation.py)
BAD_REQUEST_PATTERN = re.compile(
    r"prompt|vocabulary|sampling parameters|max_model_len|structured outputs"
)
PARAM_PATTERN = re.compile(r"`\$\.(?:sampling_params\[(\d+)\]|(\w+))")


@dataclass(slots=True)
class EngineJob:
    """One choice of a response: the request sent to an engine, what routing needs, and how
    the front end shapes its text."""

    index: int
    request: EngineCoreRequest
    prompt_token_ids: list[int]
    num_tokens: int  # prompt plus max_tokens: what the router counts as outstanding
    stops: list[str] = field(default_factory=list)  # stop strings, matched here on the text
    is_stop_shown: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    num_logprobs: int | None = None  # alternatives shown per token; None: no logprobs
    echo_text: str = ""  # shown before the output: the prompt's text, when echo asks for it


def new_response_id(prefix: str) -> str:
    """`prefix-` and 32 random hex digits, as uuid4().hex gives, at a fraction of its cost."""
    return f"{prefix}-{os.urandom(16).hex()}"


def _checked_prompt(
    prompt: str | list[int],
    tokenizer: PromptTokenizer,
    param: str,
    max_model_len: int | None,
    add_special_tokens: bool = True,
) -> list[int]:
    token_ids = tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
    _check_fits(len(token_ids), param, max_model_len)
    if not token_ids:
        raise bad_param(param, "empty prompt: expected at least one token")
    bad = [token_id for token_id in token_ids if not 0 <= token_id <= MAX_TOKEN_ID]
    if bad:
        raise bad_param(param, f"token id {bad[0]}: expected 0 <= id <= {MAX_TOKEN_ID}")
    return token_ids


def _check_fits(num_prompt_tokens: int, param: str, max_model_len: int | None) -> None:
    """A prompt that leaves no room for one output token is refused here: sent on, a prompt far
    past max_model_len is a frame the engine's socket refuses (DESIGN §1)."""
    if max_model_len is not None and num_prompt_tokens + 1 > max_model_len:
        raise bad_param(
            param,
            f"prompt of {num_prompt_tokens} tokens: expected at most {max_model_len - 1}, "
            f"so that one output token fits in max_model_len={max_model_len}",
        )


def _max_tokens(
    body: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int | None,
) -> int:
    """The request's max_tokens; the default is cut to what fits, a given value must fit."""
    param, max_tokens = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, max_tokens = "max_completion_tokens", body.max_completion_tokens
    room = None if max_model_len is None else max_model_len - num_prompt_tokens
    if max_tokens is None and room is None:
        return DEFAULT_MAX_TOKENS
    if max_tokens is None:
        # vLLM's defaults: a chat may run to the end of the context, a completion 16 tokens
        is_chat = isinstance(body, ChatCompletionRequest)
        return min(MAX_TOKENS_LIMIT if is_chat else DEFAULT_MAX_TOKENS, room)
    if room is not None and max_tokens > room:
        raise bad_param(
            param,
            f"{max_tokens} tokens after a prompt of {num_prompt_tokens}: expected at most "
            f"{room}, as max_model_len={max_model_len} bounds the prompt and output together",
        )
    return max_tokens


def _top_k(top_k: int | None) -> int | None:
    """vLLM's -1 (and 0) for every token; other values are SamplingParams' to check."""
    return None if top_k in (None, -1, 0) else top_k


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, num_logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            seed=body.seed,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=_top_k(body.top_k),
            min_p=0.0 if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logprobs=num_logprobs,
            structured_outputs=body.structured_outputs_spec(),  # a 400 of its own when bad
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
    body: CompletionRequest,
    tokenizer: PromptTokenizer,
    response_id: str,
    max_model_len: int | None = None,
) -> list[EngineJob]:
    """One job per prompt of the batch; `max_model_len` None skips the length checks."""
    body.check_supported()
    prompts = body.prompts()
    jobs = []
    for index, prompt in enumerate(prompts):
        add_special_tokens = body.add_special_tokens is not False
        token_ids = _checked_prompt(prompt, tokenizer, "prompt", max_model_len, add_special_tokens)
        job = _job(body, index, token_ids, response_id, max_model_len, body.logprobs)
        if body.echo and isinstance(prompt, str):
            job.echo_text = prompt  # the text as given
        elif body.echo:
            job.echo_text = tokenizer.decode(token_ids, skip_special_tokens=False)
        jobs.append(job)
    return jobs


def chat_job(
    body: ChatCompletionRequest,
    tokenizer: PromptTokenizer,
    response_id: str,
    max_model_len: int | None = None,
) -> EngineJob:
    body.check_supported()
    token_ids = chat_prompt_ids(
        body.messages,
        tokenizer,
        body.add_generation_prompt,
        body.tools,
        body.chat_template_kwargs,
        add_special_tokens=bool(body.add_special_tokens),
        chat_template=body.chat_template,
        continue_final_message=body.continue_final_message,
    )
    token_ids = _checked_prompt(token_ids, tokenizer, "messages", max_model_len)
    return _job(body, 0, token_ids, response_id, max_model_len, body.num_logprobs)


def chat_prompt_ids(
    messages: list[ChatMessage],
    tokenizer: PromptTokenizer,
    add_generation_prompt: bool,
    tools: list[dict[str, JsonValue]] | None = None,
    chat_template_kwargs: dict[str, JsonValue] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The ids of the rendered chat; a template's refusal is a 400 naming messages (or tools),
    a request's template that does not compile one naming chat_template."""
    plain = [message.template_message() for message in messages]
    try:
        return tokenizer.render_chat(
            plain,
            add_generation_prompt,
            tools,
            chat_template_kwargs,
            add_special_tokens,
            chat_template,
            continue_final_message,
        )
    except ChatTemplateError as exc:
        is_compile_error = chat_template is not None and str(exc).startswith(COMPILE_ERROR)
        raise bad_param("chat_template" if is_compile_error else "messages", str(exc)) from None
    except ValueError as exc:  # no template, or a byte-format role or tools
        param = "tools" if str(exc).startswith("tools") else "messages"
        raise bad_param(param, str(exc)) from None


def _job(
    body: CompletionRequest | ChatCompletionRequest,
    index: int,
    prompt_token_ids: list[int],
    response_id: str,
    max_model_len: int | None,
    num_logprobs: int | None,
) -> EngineJob:
    max_tokens = _max_tokens(body, len(prompt_token_ids), max_model_len)
    params = _sampling_params(body, max_tokens, num_logprobs)
    request = EngineCoreRequest(
        req_id=f"{response_id}-{index}",
        prompt_token_ids=pack_int32(prompt_token_ids),
        sampling_params=params,
        arrival_time=time.time(),
        priority=body.priority,
        cache_salt=body.cache_salt,
    )
    num_tokens = len(prompt_token_ids) + params.max_tokens
    checked = _checked(request)
    return EngineJob(
        index,
        checked,
        prompt_token_ids,
        num_tokens,
        stops=body.stop_strings(),
        is_stop_shown=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        num_logprobs=num_logprobs,
    )


def engine_refusal(error: str | None) -> ApiError:
    """The HTTP error of a request the engine ended with an error."""
    message = error or "the engine failed the request without a reason"
    if message.startswith(BUSY_PREFIXES):
        return ApiError(503, message, code="engine_busy")
    if BAD_REQUEST_PATTERN.search(message):
        return ApiError(400, message, param="prompt" if "prompt" in message else None)
    return ApiError(500, message)
