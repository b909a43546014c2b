"""Chat replies parsed for tool calls and reasoning through the real Serving: a scripted engine
answers with a model's text (one byte per token, so a call's arguments arrive split at every
byte), and the streamed deltas add up to the whole response: content before the calls, each
call's id, name and arguments, reasoning_content, and finish_reason "tool_calls".
"""

import asyncio
import json

import pytest

from api_server.openai.chat_output import ChatParsing
from api_server.openai.engine_requests import EngineJob, chat_job
from api_server.openai.protocol import CHAT_DECODER, parse_body
from api_server.openai.serving import ResponseShape
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from tests.unit.test_api_disconnect import stop
from tests.unit.test_api_serving import _setup
from tests.unit.tool_chat_template import TOOL_CHAT_TEMPLATE, TOOL_HISTORY, TOOLS

TOKENIZER = ByteTokenizer(chat_template=TOOL_CHAT_TEMPLATE)
END = "<END>"  # a stop string after each scripted reply: the engine's reason is then "stop"
HERMES = ChatParsing("hermes", is_auto_tool_choice_enabled=True, reasoning_parser="qwen3")
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def _job(body: dict, parsing: ChatParsing) -> EngineJob:
    full = {"messages": TOOL_HISTORY, "max_tokens": 400, "stop": [END], **body}
    parsed = parse_body(json.dumps(full).encode(), CHAT_DECODER)
    return chat_job(parsed, TOKENIZER, "chat-t", 4096, parsing)  # type: ignore[arg-type]


async def _run(
    reply: str, body: dict, parsing: ChatParsing, monkeypatch: pytest.MonkeyPatch, is_stream: bool
) -> dict | list[dict]:
    sock, serving = _setup(reply + END, monkeypatch)
    job = _job({**body, "stream": is_stream}, parsing)
    engine = asyncio.ensure_future(sock.run(job.request.req_id, None))
    shape = ResponseShape("resp", "tiny-llama", True)
    if is_stream:
        started = await serving.first_outputs([job])
        events = [event async for event in serving.stream(started, shape, include_usage=False)]
        result: dict | list[dict] = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    else:
        result = await serving.complete([job], shape)
    await engine
    await stop(*serving.pool.handles[0].client._tasks)  # the fake socket has nothing to close
    return result


def _assembled(chunks: list[dict]) -> tuple[dict, str | None]:
    """The message a client builds from a stream's deltas, and the last finish_reason."""
    message: dict = {"role": "assistant", "content": "", "reasoning_content": "", "calls": {}}
    finish_reason = None
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        finish_reason = choice["finish_reason"] or finish_reason
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            if call["index"] not in message["calls"]:
                assert set(call) == {"index", "id", "type", "function"}  # a call's first delta
                assert call["type"] == "function" and call["id"].startswith("call_")
                message["calls"][call["index"]] = {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""},
                }
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            message["calls"][call["index"]]["function"]["arguments"] += call["function"][
                "arguments"
            ]
    return message, finish_reason


def _compare(reply: str, body: dict, parsing: ChatParsing, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The whole response's message, checked against the stream's assembled one."""
    whole = asyncio.run(_run(reply, body, parsing, monkeypatch, is_stream=False))
    chunks = asyncio.run(_run(reply, body, parsing, monkeypatch, is_stream=True))
    assert isinstance(whole, dict) and isinstance(chunks, list)
    [choice] = whole["choices"]
    message = choice["message"]
    streamed, finish_reason = _assembled(chunks)
    assert finish_reason == choice["finish_reason"]
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning_content"] == (message.get("reasoning_content") or "")
    calls = [{k: v for k, v in c.items()} for c in streamed["calls"].values()]
    assert [c["function"] for c in calls] == [c["function"] for c in message.get("tool_calls", [])]
    return choice


def test_hermes_calls_after_content_whole_and_streamed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [f"<tool_call>\n{call}\n</tool_call>" for call in (WEATHER_CALL, TIME_CALL)]
    reply = "Checking both.\n" + "\n".join(calls)
    choice = _compare(reply, {"tools": TOOLS}, HERMES, monkeypatch)
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking both.\n"
    assert message["reasoning_content"] is None
    assert [
        (c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == [
        ("function", "get_weather", {"city": "Oslo", "unit": "c"}),
        ("function", "get_time", {"zone": "CET"}),
    ]
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_reasoning_then_a_call_whole_and_streamed(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = f"<think>Weather needs a tool.</think><tool_call>{WEATHER_CALL}</tool_call>"
    choice = _compare(reply, {"tools": TOOLS}, HERMES, monkeypatch)
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Weather needs a tool."
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_malformed_call_stays_content(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = "<tool_call>{get_weather: Oslo}</tool_call> sorry"
    choice = _compare(reply, {"tools": TOOLS}, HERMES, monkeypatch)
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == reply
    assert "tool_calls" not in choice["message"]


def test_reasoning_without_its_end_tag_is_all_reasoning(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = "<think>still thinking when max_tokens came"
    choice = _compare(reply, {}, HERMES, monkeypatch)
    assert choice["message"]["reasoning_content"] == "still thinking when max_tokens came"
    assert choice["message"]["content"] is None


def test_tool_choice_none_leaves_the_text_as_content(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = f"<tool_call>{WEATHER_CALL}</tool_call>"
    parsing = ChatParsing("hermes", is_auto_tool_choice_enabled=True)
    choice = _compare(reply, {"tools": TOOLS, "tool_choice": "none"}, parsing, monkeypatch)
    assert choice["message"] == {"role": "assistant", "content": reply}
    assert choice["finish_reason"] == "stop"


def test_the_tools_and_the_history_of_calls_reach_the_prompt() -> None:
    job = _job({"tools": TOOLS}, HERMES)
    prompt = TOKENIZER.decode(job.prompt_token_ids)
    assert '"name": "get_time"' in prompt  # the tools, in the system turn
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        in prompt
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    thinking_off = _job({"chat_template_kwargs": {"enable_thinking": False}}, HERMES)
    assert TOKENIZER.decode(thinking_off.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert thinking_off.output_plan is None  # no thinking to split off


def test_formats_whose_tags_are_special_tokens_keep_them_in_the_text() -> None:
    for parser in ("mistral", "llama3_json"):
        parsing = ChatParsing(parser, is_auto_tool_choice_enabled=True)
        assert not _job({"tools": TOOLS}, parsing).skip_special_tokens
        assert _job({"tools": TOOLS, "tool_choice": "none"}, parsing).skip_special_tokens
    assert _job({"tools": TOOLS}, HERMES).skip_special_tokens
