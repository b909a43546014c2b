"""bench/structured.py's pieces that need no server: the two kinds of chat it sends, the check of
a JSON reply against its schema, and its flags' bounds."""

import json

import pytest

from bench.structured import JSON_MAX_TOKENS, RESPONSE_FORMAT, _chat, _is_valid, parse_args


def test_a_structured_chat_asks_for_the_schema_and_a_plain_one_for_exact_tokens() -> None:
    structured = _chat(3, None)
    assert structured["response_format"] == RESPONSE_FORMAT
    assert structured["max_tokens"] == JSON_MAX_TOKENS and "ignore_eos" not in structured
    plain = _chat(3, 57)
    assert plain["max_tokens"] == 57 and plain["ignore_eos"] and "response_format" not in plain
    assert plain["messages"] == structured["messages"], "the same chat either way"


def test_a_reply_is_valid_only_with_every_key_and_type() -> None:
    good = {"name": "ab", "age": 3, "tags": ["red"], "ok": True}
    assert _is_valid(json.dumps(good))
    assert not _is_valid(json.dumps({**good, "extra": 1}))
    assert not _is_valid(json.dumps({**good, "name": "x" * 13}))
    assert not _is_valid(json.dumps({**good, "ok": "yes"}))
    assert not _is_valid('{"name": ')


def test_sizes_below_one_are_refused() -> None:
    assert parse_args(["--rounds", "1"]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--num-requests", "0"])
