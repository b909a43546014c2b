"""The request bodies of the OpenAI endpoints as strict pydantic models: unknown fields and wrong
types are refused, and parameters kvserve cannot honour are refused unless neutral.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api_server.errors import ApiError, bad_param

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat uses the same
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with usage and no choices
    continuous_usage_stats: bool = False  # usage on every chunk too (vLLM's extension)


class _GenerationRequest(_Strict):
    """The parameters completions and chat share."""

    model: str | None = None  # None means the one served model
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # vLLM's extra parameter: lower runs first under the priority policy
    cache_salt: str | None = None  # vLLM's extra parameter: isolates prefix-cache entries
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking field
    # Accepted only at their neutral values, since load generators send them
    repetition_penalty: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None

    def check_supported(self) -> None:
        """ApiError naming the first parameter kvserve cannot honour at the value given."""
        if self.n != 1:
            raise bad_param("n", f"n={self.n} is not supported: expected 1")
        if self.repetition_penalty not in (None, 1.0):
            raise bad_param("repetition_penalty", f"{self.repetition_penalty} unsupported: use 1")
        if self.top_p not in (None, 1.0):
            raise bad_param("top_p", f"{self.top_p} is not supported: expected 1")
        if self.stop:
            raise bad_param("stop", "stop strings are not supported: use stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "only allowed with stream=true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_param("echo", "echo=true is not supported: expected false")
        if self.logprobs is not None:
            raise bad_param("logprobs", "logprobs are not supported: expected null")
        if self.suffix:
            raise bad_param("suffix", "suffix is not supported: expected null")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_param("prompt", "empty list: expected at least one prompt or token id")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per choice, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]  # one text or one list of token ids
        return list(prompt)  # type: ignore[arg-type]  # a batch of either


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise bad_param("logprobs", "logprobs are not supported: expected false")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_param("max_completion_tokens", "give max_tokens or this, not both")


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"model {requested!r} does not exist: this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
