"""The tokenizer endpoints vLLM serves beside the OpenAI ones, in its request and response shapes:
/tokenize (a prompt, or a chat as its template renders it) and /detokenize. They use the front
end's tokenizer alone and never reach an engine.
"""

import msgspec

from api_server.openai.engine_requests import chat_prompt_ids
from api_server.openai.errors import bad_param
from api_server.openai.protocol import ChatMessage, JsonValue, check_continuation
from api_server.tokenizer.prompt_tokenizer import PromptTokenizer


class TokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's two tokenize bodies in one: a completion's `prompt` or a chat's `messages`.
    Unknown fields are dropped, as on the OpenAI routes."""

    model: str | None = None  # None means the one served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for a chat (vLLM's)
    add_generation_prompt: bool = True  # chat only
    continue_final_message: bool = False  # chat only: end inside the last message
    tools: list[dict[str, JsonValue]] | None = None  # chat only: passed to the template
    chat_template_kwargs: dict[str, JsonValue] | None = None  # chat only
    chat_template: str | None = None  # chat only: replaces the model's, when trusted
    return_token_strs: bool = False  # also each id's vocabulary entry

    def check_supported(self) -> None:
        """ApiError naming the first parameter that does not fit the request's kind."""
        if (self.prompt is None) == (self.messages is None):
            param = "prompt" if self.prompt is None else "messages"
            raise bad_param(param, "expected exactly one of prompt or messages")
        for idx, message in enumerate(self.messages or []):
            message.check(idx)
        check_continuation(self.continue_final_message, self.add_generation_prompt)


class DetokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str | None = None  # None means the one served model
    tokens: list[int]


TOKENIZE_DECODER = msgspec.json.Decoder(TokenizeRequest)
DETOKENIZE_DECODER = msgspec.json.Decoder(DetokenizeRequest)


def tokenize(
    body: TokenizeRequest, tokenizer: PromptTokenizer, max_model_len: int | None
) -> dict[str, JsonValue]:
    """vLLM's response: `count`, `max_model_len` (None until an engine has told it), `tokens`,
    and `token_strs` when asked."""
    body.check_supported()
    if body.messages is not None:
        add_special_tokens = bool(body.add_special_tokens)
        token_ids = chat_prompt_ids(
            body.messages,
            tokenizer,
            body.add_generation_prompt,
            body.tools,
            body.chat_template_kwargs,
            add_special_tokens,
            body.chat_template,
            body.continue_final_message,
        )
    else:
        assert body.prompt is not None  # check_supported: one of the two
        add_special_tokens = body.add_special_tokens is not False
        token_ids = tokenizer.encode(body.prompt, add_special_tokens)
    response: dict[str, JsonValue] = {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
    }
    if body.return_token_strs:
        response["token_strs"] = tokenizer.token_strs(token_ids)
    return response


def detokenize(body: DetokenizeRequest, tokenizer: PromptTokenizer) -> dict[str, JsonValue]:
    """vLLM's response: the ids' text as `prompt`, special tokens included."""
    vocab_size = tokenizer.vocab_size
    for idx, token_id in enumerate(body.tokens):
        if not 0 <= token_id < vocab_size:
            raise bad_param(
                f"tokens[{idx}]", f"token id {token_id}: expected 0 <= id < {vocab_size}"
            )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
