"""Lenient request bodies, without a server: an unknown field is accepted, ignored and logged once
per name; a known parameter kvserve does not implement is accepted at its default value and is
otherwise a 400 naming the parameter, the value and what is expected."""

import json
import logging

import pytest

from api_server.openai.engine_requests import chat_job, completion_jobs
from api_server.openai.errors import ApiError
from api_server.openai.ignored_fields import MAX_LOGGED_NAMES, IgnoredFields
from api_server.openai.protocol import CHAT_DECODER, COMPLETION_DECODER, parse_body
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from protocol.buffers import unpack_int32

TOKENIZER = ByteTokenizer()
MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "hi"}]


def _prompt_and_params(body: dict, ignored: IgnoredFields | None = None) -> tuple:
    """What reaches the engine for `body`: prompt ids and sampling parameters."""
    raw = json.dumps(body).encode()
    if "messages" in body:
        job = chat_job(parse_body(raw, CHAT_DECODER, ignored), TOKENIZER, "c", MAX_MODEL_LEN)  # type: ignore[arg-type]
    else:
        parsed = parse_body(raw, COMPLETION_DECODER, ignored)
        job = completion_jobs(parsed, TOKENIZER, "c", MAX_MODEL_LEN)[0]  # type: ignore[arg-type]
    return list(unpack_int32(job.request.prompt_token_ids)), job.request.sampling_params


def _refusal(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        _prompt_and_params(body)
    return info.value


def test_unknown_fields_at_any_depth_are_ignored() -> None:
    plain = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    extra = {
        **plain,
        "metadata": {"trace": "1"},
        "store": False,
        "reasoning_effort": "low",
        "stream_options": {"include_usage": True, "future_option": 1},
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be", "cache_control": {}}]},
            {"role": "assistant", "content": "ok", "refusal": None},
            {"role": "user", "content": "hi", "refusal": None},
        ],
    }
    ignored = IgnoredFields()
    prompt, params = _prompt_and_params(extra, ignored)
    assert params == _prompt_and_params(plain)[1]
    assert TOKENIZER.decode(prompt) == (
        "<|system|>be<|end|><|assistant|>ok<|end|><|user|>hi<|end|><|assistant|>"
    )
    assert sorted(ignored.logged) == [
        "messages[].content[].cache_control",
        "messages[].refusal",
        "metadata",
        "reasoning_effort",
        "store",
        "stream_options.future_option",
    ]
    ignored.check_invariants()


def test_each_unknown_field_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="api_server.openai.ignored_fields"):
        for _ in range(3):
            _prompt_and_params({"prompt": "x", "bogus": 1, "service_tier": "auto"}, ignored)
        _prompt_and_params({"prompt": "x", "bogus": 2, "other": None}, ignored)
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 3
    for name in ("'bogus'", "'service_tier'", "'other'"):
        assert sum(name in message for message in logged) == 1, logged


def test_the_names_logged_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A client sending a new random key each time must not grow the set or the log forever;
    the request itself is still served."""
    ignored = IgnoredFields()
    with caplog.at_level(logging.WARNING, logger="api_server.openai.ignored_fields"):
        for idx in range(MAX_LOGGED_NAMES + 5):
            _prompt_and_params({"prompt": "x", f"key_{idx}": 1}, ignored)
    assert len(ignored.logged) == MAX_LOGGED_NAMES
    assert len(caplog.records) == MAX_LOGGED_NAMES + 1  # and one saying no more will be
    ignored.check_invariants()


def test_a_wrong_type_is_still_a_400_naming_the_field() -> None:
    """Lenience covers unknown names only: a known field of the wrong type is refused."""
    for body, param in (
        ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
        ({"prompt": "x", "response_format": {"kind": "text"}}, "response_format.type"),
        ({"messages": [{"role": "user", "content": 5, "extra": 1}]}, "messages[0].content"),
    ):
        assert (_refusal(body).status, _refusal(body).param) == (400, param)


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"logit_bias": {}},
        {"logit_bias": None},
        {"best_of": None},
        {"best_of": 1},
        {"echo": False},
        {"prompt_logprobs": None},
        {"allowed_token_ids": None},
        {"bad_words": []},
        {"parallel_tool_calls": True},
        {"parallel_tool_calls": False},
        {"continue_final_message": False},
        {"tool_choice": "auto"},
        {"use_beam_search": False},
        {"truncate_prompt_tokens": None},
        {"guided_json": None, "guided_choice": None, "structured_outputs": None},
        {"add_special_tokens": None},
    ],
)
def test_a_known_parameter_at_its_default_is_accepted(extra: dict) -> None:
    for base in ({"prompt": "x"}, {"messages": MESSAGES}):
        if "messages" not in base and set(extra) & {"continue_final_message", "tool_choice"}:
            continue  # chat-only parameters: unknown, so ignored, on completions
        assert _prompt_and_params({**base, **extra}) == _prompt_and_params(base)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"n": 10000}, "n", ["n=10000", "expected 1 to 128"]),
        ({"best_of": 2}, "best_of", ["best_of=2", "expected null or n (1)"]),
        ({"logit_bias": {"five": -100}}, "logit_bias", ["key 'five'", "expected a token id"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema",
            ["needs json_schema.schema"],
        ),
        (
            {"prompt_logprobs": 0, "stream": True},
            "prompt_logprobs",
            ["prompt_logprobs=0", "expected null with stream=true"],
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids", ["empty list"]),
        ({"use_beam_search": True}, "use_beam_search", ["use_beam_search=True"]),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens", ["=8", "expected null"]),
        (
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "guided_regex",
            ["expected one"],
        ),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", ["one"]),
    ],
)
def test_a_known_parameter_kvserve_cannot_honour_is_a_400_naming_it(
    extra: dict, param: str, words: list[str]
) -> None:
    for base in ({"prompt": "x"}, {"messages": MESSAGES}):
        error = _refusal({**base, **extra})
        assert (error.status, error.param) == (400, param)
        assert error.message.startswith(f"{param}: ")
        assert all(word in error.message for word in words), error.message


def test_echo_with_logprobs_is_a_400_when_streamed() -> None:
    """The prompt's logprobs come with the first token, after the echoed text was streamed."""
    error = _refusal({"prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    assert (error.status, error.param) == (400, "echo")
    assert "expected echo=false, logprobs=null or stream=false" in error.message
    _, params = _prompt_and_params({"prompt": "x", "echo": True, "logprobs": 1})
    assert params.prompt_logprobs == 1  # not streamed: the prompt is scored


@pytest.mark.parametrize(
    ("extra", "param", "value"),
    [
        ({"tool_choice": "required"}, "tool_choice", "'required'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "'function'",
        ),
        (
            {"continue_final_message": True},
            "continue_final_message",
            "add_generation_prompt=false",
        ),
        ({"echo": True}, "echo", "echo=True"),
    ],
)
def test_a_chat_parameter_kvserve_cannot_honour_is_a_400_naming_it(
    extra: dict, param: str, value: str
) -> None:
    error = _refusal({"messages": MESSAGES, **extra})
    assert (error.status, error.param) == (400, param)
    assert value in error.message
    assert "expected" in error.message
