"""OpenAI's `developer` role, its newer name for system messages: rendered as `system` by a chat
template that does not mention it, and left to a template that does."""

import json

from api_server.openai.engine_requests import chat_job
from api_server.openai.protocol import CHAT_DECODER, parse_body
from api_server.tokenizer.chat_template import ChatTemplate
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer

ROLES_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
# A template that knows the role, as newer ones do, and renders it its own way
DEVELOPER_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'developer' %}<dev>{% else %}[{{ m.role }}]"
    "{% endif %}{{ m.content }}{% endfor %}"
)
MESSAGES = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "hi"},
]


def test_a_template_without_the_role_renders_developer_as_system() -> None:
    template = ChatTemplate(ROLES_TEMPLATE, {})
    assert template.render(MESSAGES) == "[system]be brief[user]hi"
    assert MESSAGES[0]["role"] == "developer"  # the caller's messages are left as they were


def test_a_template_that_names_the_role_gets_it_unchanged() -> None:
    template = ChatTemplate(DEVELOPER_TEMPLATE, {})
    assert template.render(MESSAGES) == "<dev>be brief[user]hi"


def test_a_developer_message_reaches_the_byte_format_as_system() -> None:
    body = parse_body(json.dumps({"messages": MESSAGES}).encode(), CHAT_DECODER)
    job = chat_job(body, ByteTokenizer(), "chatcmpl-x")  # type: ignore[arg-type]
    assert ByteTokenizer().decode(job.prompt_token_ids) == (
        "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    )
