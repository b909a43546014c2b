"""vLLM's /tokenize and /detokenize on the app itself (starlette's TestClient, in memory, with no
engine started): its request and response shapes, prompt or chat, refusals naming the field, and
a request's own chat_template, accepted only from a server told to trust it. The tokenizer is the
byte one (one id per byte, special tokens from 256)."""

import pytest
from starlette.testclient import TestClient

from api_server.app import ApiSettings, create_app
from api_server.tokenizer.chat_template import MAX_CACHED_TEMPLATES, TemplateCache
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
CHAT = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]
CHAT_TEXT = "<|system|>be<|end|><|user|>hi<|end|>"


def _client(api_key: str | None = None) -> TestClient:
    """The app without its lifespan: no engine, so max_model_len is not known yet."""
    settings = ApiSettings(("tcp://127.0.0.1:1",), "tiny-llama", block_size=4, api_key=api_key)
    return TestClient(create_app(settings))


def test_a_prompt_is_tokenized_in_vllms_shape() -> None:
    reply = _client().post("/tokenize", json={"model": "tiny-llama", "prompt": "Hi there"})
    assert reply.status_code == 200
    assert reply.json() == {
        "count": 8,
        "max_model_len": None,
        "tokens": list(b"Hi there"),
    }


def test_token_strs_are_the_vocabulary_entries_when_asked() -> None:
    reply = _client().post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
    assert reply.json()["token_strs"] == ["a", "Ġ", "b"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chat_is_tokenized_as_the_chat_route_renders_it(add_generation_prompt: bool) -> None:
    body = {"messages": CHAT, "add_generation_prompt": add_generation_prompt, "store": True}
    reply = _client().post("/tokenize", json=body)
    assert reply.status_code == 200
    expected = CHAT_TEXT + ("<|assistant|>" if add_generation_prompt else "")
    assert TOKENIZER.decode(reply.json()["tokens"]) == expected
    assert reply.json()["count"] == len(reply.json()["tokens"])


def test_a_chat_can_be_tokenized_with_its_final_message_open() -> None:
    body = {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}
    reply = _client().post("/tokenize", json=body)
    assert TOKENIZER.decode(reply.json()["tokens"]) == "<|system|>be<|end|><|user|>hi"


def test_detokenize_gives_the_text_with_special_tokens() -> None:
    ids = TOKENIZER.encode(CHAT_TEXT)
    reply = _client().post("/detokenize", json={"model": "tiny-llama", "tokens": ids})
    assert (reply.status_code, reply.json()) == (200, {"prompt": CHAT_TEXT})


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {"add_special_tokens": True}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [72, 100000]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"prompt": "x"}, 400, "tokens"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field(
    route: str, body: dict, status: int, param: str
) -> None:
    reply = _client().post(route, json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param


def test_the_api_key_guards_the_tokenizer_routes() -> None:
    client = _client(api_key="secret")
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    authorized = {"Authorization": "Bearer secret"}
    assert client.post("/detokenize", json={"tokens": [72]}, headers=authorized).json() == {
        "prompt": "H"
    }


SHOUTING_TEMPLATE = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"


def test_a_requests_chat_template_needs_the_server_to_trust_it() -> None:
    """vLLM's rule: a request's own template is refused unless --trust-request-chat-template."""
    body = {"messages": CHAT[1:], "chat_template": SHOUTING_TEMPLATE}
    untrusted = _client()
    for route in ("/tokenize", "/v1/chat/completions"):
        error = untrusted.post(route, json=body).json()["error"]
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
    settings = ApiSettings(
        ("tcp://127.0.0.1:1",), "tiny-llama", block_size=4, is_request_chat_template_trusted=True
    )
    trusted = TestClient(create_app(settings))
    reply = trusted.post("/tokenize", json=body)
    assert TOKENIZER.decode(reply.json()["tokens"]) == "USER: hi\n"
    broken = trusted.post("/tokenize", json={**body, "chat_template": "{% if %}"})
    assert (broken.status_code, broken.json()["error"]["param"]) == (400, "chat_template")


def test_request_templates_are_compiled_once_and_the_least_recent_dropped() -> None:
    cache = TemplateCache({})
    first = cache.get(SHOUTING_TEMPLATE)
    assert cache.get(SHOUTING_TEMPLATE) is first
    for idx in range(MAX_CACHED_TEMPLATES):
        cache.get(f"{{{{ {idx} }}}}")
        cache.check_invariants()
    assert cache.get(SHOUTING_TEMPLATE) is not first  # evicted by the newer ones, compiled again
    assert cache.get(f"{{{{ {MAX_CACHED_TEMPLATES - 1} }}}}").render([]) == str(
        MAX_CACHED_TEMPLATES - 1
    )
