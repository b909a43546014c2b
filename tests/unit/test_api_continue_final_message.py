"""vLLM's continue_final_message: the prompt ends inside the final message, with no end-of-turn
and no generation prompt, so that the model goes on with that message's text."""

import json

import pytest

from api_server.openai.engine_requests import chat_job
from api_server.openai.errors import ApiError
from api_server.openai.protocol import CHAT_DECODER, parse_body
from api_server.tokenizer.chat_template import ChatTemplate
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
PREFILLED = [
    {"role": "user", "content": "Name a city."},
    {"role": "assistant", "content": "The city is"},
]
# Trims what it prints, as Llama 3's template does, and closes every turn
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _prompt_text(body: dict) -> str:
    parsed = parse_body(json.dumps(body).encode(), CHAT_DECODER)
    job = chat_job(parsed, TOKENIZER, "chatcmpl-x")  # type: ignore[arg-type]
    return TOKENIZER.decode(job.prompt_token_ids)


def test_the_byte_format_leaves_the_final_message_open() -> None:
    body = {"messages": PREFILLED, "continue_final_message": True, "add_generation_prompt": False}
    assert _prompt_text(body) == "<|user|>Name a city.<|end|><|assistant|>The city is"


def test_a_template_that_trims_the_content_ends_at_the_trimmed_text() -> None:
    template = ChatTemplate(TRIMMING_TEMPLATE, {})
    messages = [*PREFILLED[:1], {"role": "assistant", "content": "The city is "}]
    closed = template.render(messages, add_generation_prompt=False)
    assert closed.endswith("The city is</assistant>")
    opened = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert opened == "<user>Name a city.</user><assistant>The city is"


def test_it_needs_add_generation_prompt_false_as_in_vllm() -> None:
    with pytest.raises(ApiError) as info:
        _prompt_text({"messages": PREFILLED, "continue_final_message": True})
    assert info.value.param == "continue_final_message"
    assert "expected add_generation_prompt=false" in info.value.message


def test_a_final_message_without_text_cannot_be_continued() -> None:
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [*PREFILLED[:1], {"role": "assistant", "tool_calls": calls}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    with pytest.raises(ApiError) as info:
        _prompt_text(body)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "no text to continue" in info.value.message
