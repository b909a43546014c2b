"""The request bodies of the OpenAI endpoints as msgspec Structs: wrong types are refused when
the body is decoded, unknown fields are ignored (IgnoredFields logs them), and a known parameter
kvserve cannot honour is refused unless its value asks for the default. Bounds of the sampling
parameters are SamplingParams' own (engine_requests.py).
"""

from typing import Annotated, Literal, TypeVar

import msgspec

from api_server.openai.errors import ApiError, bad_param, decode_error, quoted
from api_server.openai.ignored_fields import IgnoredFields
from api_server.openai.parallel_sampling import MAX_CHOICES_PER_PROMPT
from api_server.openai.structured_outputs import (
    MAX_JSON_SCHEMA_DEPTH,
    ResponseFormat,
    StructuredOutputsRequest,
    structured_outputs_of,
    too_deep_param,
)
from protocol.sampling import StructuredOutputs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; a chat's is what fits max_model_len
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_STOP_STRINGS = 64  # vLLM sets no limit; each is searched for in every piece of text
MAX_STOP_STRING_CHARS = 1024
# Any JSON value: tool schemas and chat_template_kwargs are passed to the template as they are
JsonValue = str | int | float | bool | None | list | dict
Body = TypeVar("Body")  # the Struct a route's decoder gives


class _Lenient(msgspec.Struct, omit_defaults=True):
    """Unknown fields are dropped on decode, as vLLM drops them."""


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk with usage and no choices
    continuous_usage_stats: bool = False  # usage on every chunk too (vLLM's extension)


def _unsupported(param: str, value: object, expected: str) -> ApiError:
    return bad_param(param, f"{param}={quoted(value)} is not supported: expected {expected}")


class _GenerationRequest(_Lenient, kw_only=True):
    """The parameters completions and chat share."""

    model: str | None = None  # None means the one served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's: -1 or 0 keeps every token
    min_p: float | None = None  # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    seed: int | None = None
    stop: str | list[str] | None = None  # ends the choice before the first match, unshown
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    n: int = 1  # independent choices per prompt, from one prefill (engine_requests.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # vLLM's extra parameter: lower runs first under the priority policy
    cache_salt: str | None = None  # vLLM's extra parameter: isolates prefix-cache entries
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking field
    # vLLM's: the special tokens the tokenizer adds around a text (a Llama's bos); None means
    # true for a completion's prompt and false for a chat, whose template writes its own
    add_special_tokens: bool | None = None
    # Known, and accepted only at the value that asks for the default behaviour
    best_of: int | None = None  # null or n
    # Completions: the prompt's text before the output (with logprobs, the prompt's lead the
    # output's, streamed: no); chat (vLLM's meaning, echoing the last message): false
    echo: bool = False
    # OpenAI's: token id (a string of an int, as JSON keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None  # json_object, json_schema: structured outputs
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top N
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be sampled
    bad_words: list[str] | None = None  # vLLM's: words the output never contains
    use_beam_search: bool = False  # vLLM's: false
    truncate_prompt_tokens: int | None = None  # vLLM's: null
    # vLLM's structured outputs, new spelling and old (api_server/openai/structured_outputs.py)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: msgspec.Raw = msgspec.Raw()  # a schema, as an object or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_supported(self) -> None:
        """ApiError naming the first parameter kvserve cannot honour at the value given."""
        if not 1 <= self.n <= MAX_CHOICES_PER_PROMPT:
            raise bad_param("n", f"n={self.n}: expected 1 to {MAX_CHOICES_PER_PROMPT}")
        self._check_defaults()
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "only allowed with stream=true")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_param(
                "stop", f"{len(stops)} stop strings: expected at most {MAX_STOP_STRINGS}"
            )
        for stop in stops:
            if not 1 <= len(stop) <= MAX_STOP_STRING_CHARS:
                raise bad_param(
                    "stop",
                    f"a stop string of {len(stop)} characters: expected 1 to "
                    f"{MAX_STOP_STRING_CHARS}",
                )

    def _check_defaults(self) -> None:
        """The parameters kvserve knows but does not implement: each may only ask for the
        behaviour it would have without the parameter."""
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", self.best_of, f"null or n ({self.n})")
        if self.prompt_logprobs is not None and self.stream:
            raise _unsupported(
                "prompt_logprobs", self.prompt_logprobs, "null with stream=true, as vLLM has it"
            )
        if self.use_beam_search:
            raise _unsupported("use_beam_search", self.use_beam_search, "false")
        if self.truncate_prompt_tokens is not None:
            raise _unsupported("truncate_prompt_tokens", self.truncate_prompt_tokens, "null")

    def structured_outputs_spec(self) -> StructuredOutputs | None:
        """The constraint the request asks for, checked (a 400 naming the field if bad)."""
        return structured_outputs_of(
            self.response_format,
            self.structured_outputs,
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
        )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def has_usage_per_chunk(self) -> bool:
        """vLLM sends usage on every chunk only when both stream options ask for it."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(_GenerationRequest, kw_only=True):
    # One text, one list of ids, or a batch of either; msgspec allows one array type in a
    # union, so the batch's shape is checked by `prompts`
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None  # alternatives per token besides the sampled one
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None and self.stream:
            raise bad_param(
                "echo",
                "echo=true with logprobs is not streamed (the prompt's logprobs come with the "
                "first token): expected echo=false, logprobs=null or stream=false",
            )
        if self.suffix:
            raise bad_param("suffix", "suffix is not supported: expected null")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_param("prompt", "empty list: expected at least one prompt or token id")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per choice, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        kinds = {type(item) for item in prompt}
        if kinds == {int}:
            return [prompt]  # type: ignore[list-item]  # one list of token ids
        if kinds == {str}:
            return list(prompt)  # type: ignore[arg-type]  # a batch of texts
        if kinds == {list}:
            return list(prompt)  # type: ignore[arg-type]  # a batch of token id lists
        raise bad_param(
            "prompt",
            "mixed list: expected a string, a list of token ids, a list of strings or "
            "a list of token id lists",
        )


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Lenient):
    """One message. An assistant message may carry tool_calls instead of content; a tool
    message answers one of them (tool_call_id)."""

    # OpenAI's newer name for system messages; rendered as system unless the template knows it
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call it answers

    def check(self, idx: int) -> None:
        """ApiError naming the first field of messages[idx] that does not fit its role."""
        where = f"messages[{idx}]"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_param(f"{where}.content", "required parameter is missing")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_param(f"{where}.tool_calls", f"on a {self.role} message: expected none")
        if self.role == "tool" and self.tool_call_id is None:
            raise bad_param(f"{where}.tool_call_id", "a tool message names the call it answers")
        for call_idx, call in enumerate(self.tool_calls or []):
            try:
                msgspec.json.decode(call.function.arguments)
            except msgspec.DecodeError as exc:
                param = f"{where}.tool_calls[{call_idx}].function.arguments"
                raise bad_param(param, f"not JSON: {exc}") from None

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict[str, JsonValue]:
        """The message as a chat template reads it: a tool call's arguments are parsed from JSON
        into a dict, as vLLM passes them, since templates iterate or re-encode them."""
        message: dict[str, JsonValue] = {"role": self.role}
        if self.content is not None:
            message["content"] = self.text()
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {
                        "name": call.function.name,
                        "arguments": msgspec.json.decode(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token; needs logprobs=true
    tools: list[dict[str, JsonValue]] | None = None  # passed to the chat template as they are
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; None means
    # "auto" on a server with --enable-auto-tool-choice, "none" elsewhere (chat_output.py)
    tool_choice: str | dict[str, JsonValue] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call; None means true
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's opening
    chat_template_kwargs: dict[str, JsonValue] | None = None  # vLLM's: more template variables
    # vLLM's: end the prompt inside the last message, for the model to go on with it
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: replaces the model's (--trust-request-chat-template)

    def check_supported(self) -> None:
        super().check_supported()
        for idx, message in enumerate(self.messages):
            message.check(idx)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_param("max_completion_tokens", "give max_tokens or this, not both")
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        if self.echo:
            raise _unsupported("echo", self.echo, "false")

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for SamplingParams.logprobs; None when none are asked."""
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a prompt cannot both continue the last message and open a new one."""
    if continue_final_message and add_generation_prompt:
        raise bad_param(
            "continue_final_message",
            "continue_final_message=true with add_generation_prompt=true: expected "
            "add_generation_prompt=false, as the prompt cannot both continue the final message "
            "and open a new one",
        )


COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


def parse_body(
    body: bytes, decoder: msgspec.json.Decoder[Body], ignored: IgnoredFields | None = None
) -> Body:
    """The decoded body, its unknown fields noted in `ignored`; a 400 naming the parameter at
    fault otherwise."""
    try:
        parsed = decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise decode_error(exc) from None
    except RecursionError:  # msgspec's own bound on nesting, even in a field it only skips
        param = too_deep_param(body)
        message = f"nested more than {MAX_JSON_SCHEMA_DEPTH} levels deep: expected at most that"
        raise ApiError(400, f"{param}: {message}", param=param) from None
    if ignored is not None:
        ignored.note(body, decoder.type)
    return parsed


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """A 404 unless `requested` is None or one of the served names (vLLM's --served-model-name)."""
    if requested is not None and requested not in served:
        names = served[0] if len(served) == 1 else list(served)
        raise ApiError(
            404,
            f"model {requested!r} does not exist: this server serves {names!r}",
            param="model",
            code="model_not_found",
        )
