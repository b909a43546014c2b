"""Turning an OpenAI request into EngineCoreRequests (one per choice: n per prompt), with every
bound checked here so that a bad value is a 400 naming its parameter, a prompt that cannot fit the
engines' max_model_len or a token id past their vocabulary included (it never reaches an engine);
and the HTTP status of an engine's refusal.
"""

import os
import re
import time
from dataclasses import dataclass, field

import msgspec

from api_server.openai.chat_output import ChatParsing, OutputPlan
from api_server.openai.errors import ApiError, bad_param, quoted
from api_server.openai.generation_config import NO_DEFAULTS, GenerationDefaults
from api_server.openai.parallel_sampling import choice_seed
from api_server.openai.protocol import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JsonValue,
)
from api_server.routing import ChoiceGroup
from api_server.tokenizer.chat_template import COMPILE_ERROR, ChatTemplateError
from api_server.tokenizer.prompt_tokenizer import PromptTokenizer
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
# The SamplingParams fields of token rules, as they are built once per body (the choices share them)
TokenRules = dict[str, object]
# The engine names the sampling field whose token id is out of the vocabulary (validation.py)
TOKEN_FIELD_PATTERN = re.compile(r"^(stop_token_ids|logit_bias|allowed_token_ids|bad_words) token")
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
    output_plan: OutputPlan | None = None  # chat: reasoning and tool calls parsed from the text
    is_prompt_counted: bool = True  # false for a prompt's choices past the first (usage)
    has_prompt_logprobs: bool = False  # shown in vLLM's prompt_logprobs shape
    group: ChoiceGroup | None = None  # shared by a prompt's choices when n > 1: one engine
    is_echo_scored: bool = False  # echo with logprobs: the prompt's logprobs lead the output's


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
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> int:
    """The request's max_tokens; the default is cut to what fits, a given value must fit."""
    param, max_tokens = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        param, max_tokens = "max_completion_tokens", body.max_completion_tokens
    room = None if max_model_len is None else max_model_len - num_prompt_tokens
    if max_tokens is None:
        # vLLM's defaults: a chat may run to the end of the context, a completion 16 tokens;
        # the checkpoint's max_new_tokens (--generation-config) bounds either
        is_chat = isinstance(body, ChatCompletionRequest)
        limits = [MAX_TOKENS_LIMIT if is_chat else DEFAULT_MAX_TOKENS, room, defaults.max_tokens]
        return max(1, min(limit for limit in limits if limit is not None))
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


def _or(value: float | None, default: float | None, fallback: float) -> float:
    """The request's value, else the --generation-config default, else kvserve's own."""
    if value is not None:
        return value
    return fallback if default is None else default


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    num_logprobs: int | None,
    seed: int | None,
    rules: TokenRules,
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=_or(body.temperature, defaults.temperature, DEFAULT_TEMPERATURE),
            seed=seed,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            top_p=_or(body.top_p, defaults.top_p, 1.0),
            top_k=_top_k(top_k),
            min_p=_or(body.min_p, defaults.min_p, 0.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=_or(body.repetition_penalty, defaults.repetition_penalty, 1.0),
            logprobs=num_logprobs,
            prompt_logprobs=_num_prompt_logprobs(body, num_logprobs),
            structured_outputs=body.structured_outputs_spec(),  # a 400 of its own when bad
            **rules,  # type: ignore[arg-type]  # checked with every bound by _checked
        )
    except ValueError as exc:  # __post_init__: min_tokens above max_tokens
        raise bad_param("min_tokens", str(exc)) from None


def _num_prompt_logprobs(
    body: CompletionRequest | ChatCompletionRequest, num_logprobs: int | None
) -> int | None:
    """The engine's prompt_logprobs: the request's own, or as many alternatives as its
    logprobs when a completion echoes its prompt with logprobs (the most of both)."""
    asked = body.prompt_logprobs
    if isinstance(body, CompletionRequest) and body.echo and num_logprobs is not None:
        return num_logprobs if asked is None else max(asked, num_logprobs)
    return asked


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


def token_rules(
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: PromptTokenizer,
    vocab_size: int | None,
) -> TokenRules:
    """logit_bias, allowed_token_ids and bad words as SamplingParams fields: logit_bias's string
    keys as ids, each bad word tokenized as vLLM does (as given, and after a space, since a word
    inside a text usually starts with one); a 400 naming the field and the first id outside the
    vocabulary (`vocab_size` None skips that check: the engine makes it too)."""
    rules: TokenRules = {}
    if body.logit_bias:
        logit_bias = {}
        for key, bias in body.logit_bias.items():
            try:
                logit_bias[int(key)] = bias
            except ValueError:
                raise bad_param(
                    "logit_bias", f"key {key!r}: expected a token id (an integer)"
                ) from None
        rules["logit_bias"] = logit_bias
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise bad_param("allowed_token_ids", "empty list: expected at least one token id")
        rules["allowed_token_ids"] = body.allowed_token_ids
    if body.bad_words:
        rules["bad_words_token_ids"] = bad_words_token_ids(body.bad_words, tokenizer)
    if vocab_size is not None:
        _check_vocabulary(rules, vocab_size)
    return rules


def bad_words_token_ids(bad_words: list[str], tokenizer: PromptTokenizer) -> list[list[int]]:
    """Each word's ids as it starts a text and as it follows a space (vLLM's two spellings),
    without repeats; a word that tokenizes to nothing bans nothing."""
    words: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            if token_ids and token_ids not in words:
                words.append(token_ids)
    return words


def _check_vocabulary(rules: TokenRules, vocab_size: int) -> None:
    fields = {
        "logit_bias": list(rules.get("logit_bias", {})),  # type: ignore[call-overload]
        "allowed_token_ids": rules.get("allowed_token_ids", []),
    }
    for param, token_ids in fields.items():
        for token_id in token_ids:  # type: ignore[attr-defined]
            if not 0 <= token_id < vocab_size:
                raise bad_param(
                    param, f"token id {token_id}: expected 0 <= id < {vocab_size} (the vocabulary)"
                )


def completion_jobs(
    body: CompletionRequest,
    tokenizer: PromptTokenizer,
    response_id: str,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> list[EngineJob]:
    """n jobs per prompt of the batch, choice index prompt * n + i as vLLM numbers them;
    `max_model_len` None skips the length checks, `vocab_size` None the vocabulary's."""
    body.check_supported()
    prompts = body.prompts()
    rules = token_rules(body, tokenizer, vocab_size)
    jobs = []
    for prompt_idx, prompt in enumerate(prompts):
        add_special_tokens = body.add_special_tokens is not False
        token_ids = _checked_prompt(prompt, tokenizer, "prompt", max_model_len, add_special_tokens)
        echo_text = ""
        if body.echo and isinstance(prompt, str):
            echo_text = prompt  # the text as given
        elif body.echo:
            echo_text = tokenizer.decode(token_ids, skip_special_tokens=False)
        group = ChoiceGroup() if body.n > 1 else None
        for choice_idx in range(body.n):
            index = prompt_idx * body.n + choice_idx
            job = _job(
                body, index, token_ids, response_id, max_model_len, body.logprobs, rules, defaults
            )
            job.request = _with_seed(job.request, choice_seed(body.seed, choice_idx))
            job.echo_text = echo_text
            job.is_echo_scored = body.echo and body.logprobs is not None
            job.is_prompt_counted = choice_idx == 0
            job.group = group
            jobs.append(job)
    return jobs


def _with_seed(request: EngineCoreRequest, seed: int | None) -> EngineCoreRequest:
    if seed == request.sampling_params.seed:
        return request
    return msgspec.structs.replace(
        request, sampling_params=msgspec.structs.replace(request.sampling_params, seed=seed)
    )


def chat_job(
    body: ChatCompletionRequest,
    tokenizer: PromptTokenizer,
    response_id: str,
    max_model_len: int | None = None,
    chat_parsing: ChatParsing | None = None,
) -> EngineJob:
    """The one job of a chat of one choice (n=1); ValueError for more, which need chat_jobs."""
    jobs = chat_jobs(body, tokenizer, response_id, max_model_len, chat_parsing)
    if len(jobs) != 1:
        raise ValueError(f"chat_job builds one choice, the body asks n={body.n}: use chat_jobs")
    return jobs[0]


def chat_jobs(
    body: ChatCompletionRequest,
    tokenizer: PromptTokenizer,
    response_id: str,
    max_model_len: int | None = None,
    chat_parsing: ChatParsing | None = None,
    *,
    vocab_size: int | None = None,
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> list[EngineJob]:
    """The chat's n choices, one job each (see completion_jobs); `chat_parsing` (the server's
    parsers) decides what its replies are parsed for, and a tool_choice that forces calls
    constrains each reply to their schema."""
    body.check_supported()
    plan = (chat_parsing or ChatParsing()).plan(
        body.tools, body.tool_choice, body.parallel_tool_calls, body.chat_template_kwargs
    )
    rules = token_rules(body, tokenizer, vocab_size)
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
    jobs = []
    group = ChoiceGroup() if body.n > 1 else None
    for index in range(body.n):
        job = _job(
            body, index, token_ids, response_id, max_model_len, body.num_logprobs, rules, defaults
        )
        job.request = _with_seed(job.request, choice_seed(body.seed, index))
        job.is_prompt_counted = index == 0
        job.group = group
        if plan is not None:
            _apply_plan(job, plan)
        jobs.append(job)
    return jobs


def _apply_plan(job: EngineJob, plan: OutputPlan) -> None:
    """The job parsed as `plan` says: its special tokens kept where the tool format's tags are
    ones, and its reply constrained where tool_choice forces calls."""
    job.output_plan = plan
    if plan.needs_special_tokens:
        job.skip_special_tokens = False
    if plan.constraint is None:
        return
    params = job.request.sampling_params
    if params.structured_outputs is not None:
        raise bad_param(
            "tool_choice",
            "a tool_choice that forces calls constrains the reply itself: expected no "
            "response_format or structured_outputs beside it",
        )
    params = msgspec.structs.replace(params, structured_outputs=plan.constraint)
    job.request = _checked(msgspec.structs.replace(job.request, sampling_params=params))


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
    rules: TokenRules,
    defaults: GenerationDefaults,
) -> EngineJob:
    max_tokens = _max_tokens(body, len(prompt_token_ids), max_model_len, defaults)
    params = _sampling_params(body, max_tokens, num_logprobs, body.seed, rules, defaults)
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
        has_prompt_logprobs=body.prompt_logprobs is not None,
    )


def engine_refusal(error: str | None) -> ApiError:
    """The HTTP error of a request the engine ended with an error."""
    message = error or "the engine failed the request without a reason"
    if message.startswith(BUSY_PREFIXES):
        return ApiError(503, message, code="engine_busy")
    if BAD_REQUEST_PATTERN.search(message):
        field = TOKEN_FIELD_PATTERN.match(message)
        if field is not None:
            return ApiError(400, message, param=field.group(1))
        return ApiError(400, message, param="prompt" if "prompt" in message else None)
    return ApiError(500, message)
