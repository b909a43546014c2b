"""Tool call and reasoning parsers on whole replies and on the same text split at every
character: the pieces always add up to the whole parse, text before a call stays content, a
call that is no JSON call stays content, and text that may begin a tag waits until it cannot.
"""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api_server.openai.chat_output import ChatOutputParser, OutputPlan, ToolMode
from api_server.openai.reasoning_parser import ReasoningParser
from api_server.openai.tool_parsers import TOOL_PARSERS, ParsedDelta

Call = tuple[str, dict]  # a call's name and its parsed arguments

CASES: list[tuple[str, str, str, list[Call]]] = [
    # parser, reply, content, calls
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": [1, 2.5, {"note": "a }] in a string"}]}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look.\n",
        [
            ("get_weather", {"city": "Paris", "days": [1, 2.5, {"note": "a }] in a string"}]}),
            ("get_time", {}),
        ],
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> then text",
        "<tool_call>not json</tool_call> then text",
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        [],
    ),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "cut sh', "", [("f", {"q": "cut sh"})]),
    (
        "hermes",
        'Ünïcødé 🙂 <tool_call>{"name": "f", "arguments": {"s": "é🙂"}}</tool_call>',
        "Ünïcødé 🙂 ",
        [("f", {"s": "é🙂"})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
        '"parameters": {"zone": "a;b"}}',
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "a;b"})],
    ),
    (
        "llama3_json",
        'Sure.<|python_tag|>{"name": "f", "parameters": {"n": -1.5e3}}',
        "Sure.",
        [("f", {"n": -1500.0})],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "no calls <|python", "no calls <|python", []),
    (
        "mistral",
        'Calling. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Calling. ",
        [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})],
    ),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "half a tag [TOOL_CA", "half a tag [TOOL_CA", []),
    ("mistral", "[TOOL_CALLS]  ", "[TOOL_CALLS]  ", []),
    ("mistral", '[TOOL_CALLS][{"x": 1}] and more', '[TOOL_CALLS][{"x": 1}] and more', []),
]


def _assembled(pieces: list[ParsedDelta]) -> tuple[str, list[tuple[str, str, str]]]:
    """The content and each call's (id, name, arguments text) that deltas add up to, checking
    that a call's first delta, and only it, carries the id and name."""
    content, calls = "", {}
    for piece in pieces:
        content += piece.content
        for delta in piece.tool_calls or []:
            if delta.index not in calls:
                assert delta.name is not None and delta.id is not None, delta
                calls[delta.index] = [delta.id, delta.name, ""]
            else:
                assert delta.name is None and delta.id is None, delta
            calls[delta.index][2] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))  # numbered from 0 as they begin
    return content, [tuple(calls[idx]) for idx in sorted(calls)]  # type: ignore[misc]


def _without_ids(assembled: tuple[str, list]) -> tuple[str, list]:
    content, calls = assembled
    return content, [(name, arguments) for _, name, arguments in calls]


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_a_whole_reply_parses_into_content_and_calls(
    name: str, reply: str, content: str, calls: list[Call]
) -> None:
    parsed_content, parsed_calls = _assembled([TOOL_PARSERS[name]().parse(reply)])
    assert parsed_content == content
    assert [(n, json.loads(arguments)) for _, n, arguments in parsed_calls] == calls
    ids = [call_id for call_id, _, _ in parsed_calls]
    assert all(call_id.startswith("call_") for call_id in ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_a_reply_split_anywhere_adds_up_to_the_whole_parse(
    name: str, reply: str, content: str, calls: list[Call]
) -> None:
    whole = _without_ids(_assembled([TOOL_PARSERS[name]().parse(reply)]))
    for split in range(len(reply) + 1):
        parser = TOOL_PARSERS[name]()
        pieces = [parser.push(reply[:split]), parser.push(reply[split:]), parser.finish()]
        assert _without_ids(_assembled(pieces)) == whole, split
    parser = TOOL_PARSERS[name]()
    pieces = [parser.push(char) for char in reply] + [parser.finish()]
    assert _without_ids(_assembled(pieces)) == whole


def test_arguments_stream_while_the_call_is_open() -> None:
    """The name goes out as soon as it is whole, and argument pieces follow value by value
    before the call's end tag has come, never to be taken back."""
    parser = TOOL_PARSERS["hermes"]()
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    sent: list[str] = []
    names = []
    for char in reply:
        for delta in parser.push(char).tool_calls or []:
            if delta.name is not None:
                names.append((len(sent), delta.name))
            sent.append(delta.arguments)
    assert names == [(0, "get_weather")]
    assert "".join(sent) == '{"city": "Paris", "unit": "c"'  # the closing brace waits
    assert len([piece for piece in sent if piece]) >= 2  # streamed in more than one piece
    rest = parser.finish().tool_calls
    assert (
        rest is not None and "".join(sent) + rest[0].arguments == '{"city": "Paris", "unit": "c"}'
    )


def test_text_that_may_begin_a_tag_waits_until_it_cannot() -> None:
    parser = TOOL_PARSERS["hermes"]()
    assert parser.push("Hello <tool").content == "Hello "
    assert parser.push("box>").content == "<toolbox>"
    assert parser.push("<").content == ""
    assert parser.finish().content == "<"


@pytest.mark.parametrize(
    ("name", "reply", "reasoning", "content"),
    [
        ("qwen3", "<think>Plan: add.</think>\n\n2 + 2 = 4", "Plan: add.", "\n\n2 + 2 = 4"),
        ("qwen3", "No thinking here", "", "No thinking here"),
        ("qwen3", "<think>cut short while thin", "cut short while thin", ""),
        ("qwen3", "<thin", "", "<thin"),
        ("deepseek_r1", "Reason first.</think>Answer.", "Reason first.", "Answer."),
        ("deepseek_r1", "<think>Tagged too.</think>Answer.", "Tagged too.", "Answer."),
        ("deepseek_r1", "never ends </thi", "never ends </thi", ""),
    ],
)
def test_reasoning_splits_from_content_whole_and_split_anywhere(
    name: str, reply: str, reasoning: str, content: str
) -> None:
    for split in range(len(reply) + 1):
        parser = ReasoningParser(name)
        pieces = [parser.push(reply[:split]), parser.push(reply[split:]), parser.finish()]
        assert "".join(p.reasoning for p in pieces) == reasoning, split
        assert "".join(p.content for p in pieces) == content, split


def _stream_message(parser: ChatOutputParser, reply: str) -> dict:
    """The message a client assembles from the stream's deltas of `reply`, char by char."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for idx, char in enumerate(reply):
        delta = parser.delta(char, is_last=idx == len(reply) - 1)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        message["content"] += delta.get("content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
            if "id" in call:
                entry.update(id=call["id"], type=call["type"], name=call["function"]["name"])
            entry["arguments"] += call["function"]["arguments"]
    return message


def test_tool_calls_are_parsed_from_the_content_after_the_reasoning() -> None:
    reply = (
        "<think>The user wants weather.</think>Checking.<tool_call>"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    )
    plan = OutputPlan(ToolMode.AUTO, "hermes", reasoning_parser="qwen3")
    whole = plan.parser().message(reply)
    assert whole["reasoning_content"] == whole["reasoning"] == "The user wants weather."
    assert whole["content"] == "Checking."
    [call] = whole["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo", "unit": "c"}',
    }
    streamed = _stream_message(plan.parser(), reply)
    assert streamed["content"] == whole["content"]
    assert streamed["reasoning_content"] == whole["reasoning_content"]
    [entry] = streamed["tool_calls"].values()
    assert (entry["name"], entry["arguments"]) == ("get_weather", call["function"]["arguments"])


def test_only_the_first_call_is_kept_without_parallel_tool_calls() -> None:
    reply = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    plan = OutputPlan(ToolMode.AUTO, "hermes", is_parallel=False)
    parser = plan.parser()
    assert [c["function"]["name"] for c in parser.message(reply)["tool_calls"]] == ["a"]
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"
    assert list(_stream_message(plan.parser(), reply)["tool_calls"]) == [0]


def test_a_reply_without_calls_keeps_its_content_and_reason() -> None:
    parser = OutputPlan(ToolMode.AUTO, "hermes").parser()
    assert parser.message("just text") == {"role": "assistant", "content": "just text"}
    assert parser.finish_reason("stop") == "stop"


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(-1e6, 1e6, allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(
    arguments=st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4),
    name=st.sampled_from(list(TOOL_PARSERS)),
    data=st.data(),
)
def test_any_arguments_come_back_whole_however_the_text_is_split(
    arguments: dict, name: str, data: st.DataObject
) -> None:
    """Strings holding brackets, quotes, escapes and tags' characters, numbers cut anywhere:
    the arguments streamed add up to the whole parse, which is the arguments written."""
    written = json.dumps(arguments, ensure_ascii=data.draw(st.booleans()))
    reply = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {written}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {written}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {written}}}]',
    }[name]
    whole = _without_ids(_assembled([TOOL_PARSERS[name]().parse(reply)]))
    [(call_name, text)] = whole[1]
    assert (whole[0], call_name, json.loads(text)) == ("", "f", arguments)
    splits = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    parser = TOOL_PARSERS[name]()
    bounds = [0, *splits, len(reply)]
    pieces = [parser.push(reply[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]
    assert _without_ids(_assembled(pieces)) == whole
