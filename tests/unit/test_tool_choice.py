"""tool_choice against the tools and the server's flags: the schema that "required" and a named
function constrain a reply to accepts exactly the calls that fit the tools (checked with
jsonschema on sample replies), such replies parse into OpenAI tool_calls, and a choice that
cannot be served is a 400 naming the field.
"""

import json

import jsonschema
import pytest

from api_server.openai.chat_output import ChatParsing, OutputPlan, ToolMode
from api_server.openai.engine_requests import chat_job
from api_server.openai.errors import ApiError
from api_server.openai.protocol import CHAT_DECODER, parse_body
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from tests.unit.tool_chat_template import TIME_TOOL, TOOL_CHAT_TEMPLATE, TOOLS, WEATHER_TOOL

TOKENIZER = ByteTokenizer(chat_template=TOOL_CHAT_TEMPLATE)
MESSAGES = [{"role": "user", "content": "Weather?"}]
AUTO = ChatParsing("hermes", is_auto_tool_choice_enabled=True, reasoning_parser="qwen3")


def _plan(parsing: ChatParsing = AUTO, **body: object) -> OutputPlan | None:
    return parsing.plan(
        body.get("tools"),  # type: ignore[arg-type]
        body.get("tool_choice"),  # type: ignore[arg-type]
        body.get("parallel_tool_calls"),  # type: ignore[arg-type]
        body.get("chat_template_kwargs"),  # type: ignore[arg-type]
    )


def _schema(plan: OutputPlan | None) -> dict:
    assert plan is not None and plan.constraint is not None and plan.constraint.json is not None
    return json.loads(plan.constraint.json)


def test_required_accepts_only_calls_that_fit_a_tool() -> None:
    plan = _plan(tools=TOOLS, tool_choice="required")
    assert plan is not None and plan.tool_mode is ToolMode.REQUIRED
    assert plan.reasoning_parser is None  # the reply is JSON from its first token
    schema = _schema(plan)
    jsonschema.Draft202012Validator.check_schema(schema)
    weather = {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}
    time = {"name": "get_time", "parameters": {"zone": "CET"}}
    jsonschema.validate([weather], schema)
    jsonschema.validate([weather, time], schema)  # parallel calls by default
    refused = [
        [],  # at least one call
        [{"name": "get_news", "parameters": {}}],  # not a tool
        [{"name": "get_time", "parameters": {"city": "Oslo", "unit": "c"}}],  # another's args
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "k"}}],
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],  # a required one missing
        [{"name": "get_time"}],
        [{**time, "extra": 1}],
    ]
    for reply in refused:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(reply, schema)


def test_required_without_parallel_calls_allows_one() -> None:
    schema = _schema(_plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    call = {"name": "get_time", "parameters": {"zone": "UTC"}}
    jsonschema.validate([call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], schema)


def test_a_named_function_constrains_the_reply_to_its_parameters() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = _plan(tools=TOOLS, tool_choice=choice)
    assert plan is not None and plan.tool_mode is ToolMode.NAMED
    schema = _schema(plan)
    assert schema == WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate({"city": "Rome", "unit": "f"}, schema)


def test_definitions_move_to_the_root_where_references_point() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/day"}},
                "required": ["when"],
                "$defs": {"day": {"enum": ["mon", "tue"]}},
            },
        },
    }
    schema = _schema(_plan(tools=[tool, TIME_TOOL], tool_choice="required"))
    assert schema["$defs"] == {"day": {"enum": ["mon", "tue"]}}
    jsonschema.validate([{"name": "book", "parameters": {"when": "mon"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "book", "parameters": {"when": "sun"}}], schema)


def test_constrained_replies_parse_into_tool_calls_whole_and_streamed() -> None:
    """What vLLM returns for required and named choices: the calls of the constrained JSON,
    with finish_reason tool_calls, streamed as deltas that add up to them."""
    reply = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},
            {"name": "get_time", "parameters": {"zone": "CET"}},
        ]
    )
    plan = _plan(tools=TOOLS, tool_choice="required")
    assert plan is not None
    parser = plan.parser()
    message = parser.message(reply)
    assert message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert parser.finish_reason("stop") == "tool_calls"
    streamed = plan.parser()
    arguments: dict[int, str] = {}
    for idx, char in enumerate(reply):
        for call in streamed.delta(char, is_last=idx == len(reply) - 1).get("tool_calls", []):
            arguments[call["index"]] = (
                arguments.get(call["index"], "") + call["function"]["arguments"]
            )
    assert list(arguments.values()) == [c["function"]["arguments"] for c in message["tool_calls"]]
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named is not None
    [call] = named.parser().message('{"zone": "UTC"}')["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_plans_follow_the_servers_flags_and_the_request() -> None:
    assert _plan(ChatParsing(), tools=TOOLS) is None  # tools are only rendered
    assert _plan(ChatParsing(), tools=TOOLS, tool_choice="none") is None
    assert _plan(ChatParsing(), tool_choice="auto") is None  # nothing to call
    auto = _plan(tools=TOOLS)
    assert auto is not None and auto.tool_mode is ToolMode.AUTO and auto.constraint is None
    assert auto.reasoning_parser == "qwen3"
    off = _plan(tools=TOOLS, tool_choice="none", chat_template_kwargs={"enable_thinking": False})
    assert off is None
    mistral = _plan(ChatParsing("mistral", is_auto_tool_choice_enabled=True), tools=TOOLS)
    assert mistral is not None and mistral.needs_special_tokens


@pytest.mark.parametrize(
    ("parsing", "body", "words"),
    [
        (AUTO, {"tool_choice": "required"}, "needs tools"),
        (AUTO, {"tools": TOOLS, "tool_choice": "any"}, "expected 'none', 'auto', 'required'"),
        (
            AUTO,
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "function 'nope' is not among the tools",
        ),
        (ChatParsing(), {"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    ],
)
def test_a_tool_choice_that_cannot_be_served_is_a_400_naming_it(
    parsing: ChatParsing, body: dict, words: str
) -> None:
    with pytest.raises(ApiError) as refused:
        _plan(parsing, **body)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    assert words in refused.value.message


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        ([{"type": "retrieval"}], "tools[0].type is 'retrieval'"),
        ([{"type": "function", "function": {}}], "tools[0].function.name is missing"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "parameters"),
    ],
)
def test_a_tool_not_in_openai_shape_is_a_400_naming_tools(tools: list, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        _plan(tools=tools)
    assert (refused.value.status, refused.value.param) == (400, "tools")
    assert words in refused.value.message


def test_a_forcing_choice_puts_its_schema_on_the_engine_request() -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    job = chat_job(
        parse_body(json.dumps(body).encode(), CHAT_DECODER), TOKENIZER, "chat-t", 4096, AUTO
    )  # type: ignore[arg-type]
    constraint = job.request.sampling_params.structured_outputs
    assert constraint is not None and constraint.json is not None
    assert json.loads(constraint.json)["items"]["anyOf"][0]["properties"]["name"] == {
        "type": "string",
        "enum": ["get_weather"],
    }
    assert job.output_plan is not None and job.output_plan.tool_mode is ToolMode.REQUIRED
    plain = chat_job(
        parse_body(json.dumps({"messages": MESSAGES, "tools": TOOLS}).encode(), CHAT_DECODER),
        TOKENIZER,
        "chat-t",
        4096,
        AUTO,
    )  # type: ignore[arg-type]
    assert plain.request.sampling_params.structured_outputs is None


def test_a_forcing_choice_beside_another_constraint_is_a_400() -> None:
    """Two constraints cannot both hold: a reply constrained by response_format as well would
    match neither schema for sure."""
    import msgspec

    from api_server.openai.engine_requests import _apply_plan
    from protocol.sampling import StructuredOutputs

    job = chat_job(
        parse_body(json.dumps({"messages": MESSAGES}).encode(), CHAT_DECODER),  # type: ignore[arg-type]
        TOKENIZER,
        "chat-t",
        4096,
        AUTO,
    )
    params = msgspec.structs.replace(
        job.request.sampling_params, structured_outputs=StructuredOutputs(json_object=True)
    )
    job.request = msgspec.structs.replace(job.request, sampling_params=params)
    plan = _plan(tools=TOOLS, tool_choice="required")
    assert plan is not None
    with pytest.raises(ApiError) as refused:
        _apply_plan(job, plan)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
