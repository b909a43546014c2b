"""How a chat's reply text becomes an OpenAI message: ChatParsing (the server's parsers) plans
per request what to parse, and a ChatOutputParser per choice splits the text into reasoning,
content and tool calls, whole or as stream deltas. Reasoning comes first; tool calls are
parsed from the content after it.
"""

import enum
from dataclasses import dataclass

from api_server.openai.errors import bad_param
from api_server.openai.reasoning_parser import ReasoningDelta, ReasoningParser
from api_server.openai.tool_choice import (
    REQUIRED_ARGUMENTS_KEY,
    check_tool_choice,
    forced_constraint,
    named_function,
)
from api_server.openai.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolCallDelta, ToolParser
from api_server.openai.tool_parsers.json_calls import JsonArrayToolParser
from api_server.openai.tool_parsers.tool_parser import new_tool_call_id
from protocol.sampling import StructuredOutputs

JsonObject = dict[str, object]


class ToolMode(enum.Enum):
    AUTO = "auto"  # the server's tool parser finds calls in the text, if any
    REQUIRED = "required"  # the reply is a constrained JSON array of calls
    NAMED = "named"  # the reply is the constrained arguments of one named function


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What one request's replies are parsed for."""

    tool_mode: ToolMode | None = None
    tool_call_parser: str | None = None  # AUTO: the --tool-call-parser
    function_name: str | None = None  # NAMED: the function
    is_parallel: bool = True  # false: only the first call is kept (parallel_tool_calls)
    reasoning_parser: str | None = None
    constraint: StructuredOutputs | None = None  # REQUIRED and NAMED: the reply's schema

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the tool format's tags are special tokens that the text must keep."""
        if self.tool_mode is not ToolMode.AUTO or self.tool_call_parser is None:
            return False
        return TOOL_PARSERS[self.tool_call_parser].needs_special_tokens

    def parser(self) -> "ChatOutputParser":
        return ChatOutputParser(self)


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """The server's parsers: --tool-call-parser, --enable-auto-tool-choice (without it,
    tool_choice "auto" is refused and tools without a tool_choice are only rendered, as
    "none"), and --reasoning-parser."""

    tool_call_parser: str | None = None
    is_auto_tool_choice_enabled: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool call parser {self.tool_call_parser!r}: expected one of {list(TOOL_PARSERS)}"
            )
        if self.is_auto_tool_choice_enabled and self.tool_call_parser is None:
            raise ValueError("auto tool choice needs a tool call parser")
        if self.reasoning_parser is not None:
            ReasoningParser(self.reasoning_parser)  # refuses an unknown name

    def plan(
        self,
        tools: list[JsonObject] | None,
        tool_choice: str | JsonObject | None,
        parallel_tool_calls: bool | None = None,
        chat_template_kwargs: JsonObject | None = None,
    ) -> OutputPlan | None:
        """The request's plan, None when its text is shown as it is; a 400 naming tool_choice
        (or tools) when the choice cannot be served."""
        check_tool_choice(tools, tool_choice)
        is_parallel = parallel_tool_calls is not False  # OpenAI's default is true
        name = named_function(tool_choice)
        constraint = forced_constraint(tools, tool_choice, is_parallel)
        is_auto = bool(tools) and (
            tool_choice == "auto" or (tool_choice is None and self.is_auto_tool_choice_enabled)
        )
        if is_auto and not self.is_auto_tool_choice_enabled:
            raise bad_param(
                "tool_choice",
                "tool_choice='auto' needs a server started with --enable-auto-tool-choice and "
                "--tool-call-parser: expected 'none', 'required' or a named function",
            )
        mode = None
        if name is not None:
            mode = ToolMode.NAMED
        elif constraint is not None:
            mode = ToolMode.REQUIRED
        elif is_auto:
            mode = ToolMode.AUTO
        reasoning = self.reasoning_parser
        is_thinking_off = (chat_template_kwargs or {}).get("enable_thinking") is False
        if constraint is not None or is_thinking_off:
            reasoning = None  # a constrained reply is JSON from its first token: no thinking
        if mode is None and reasoning is None:
            return None
        parser = self.tool_call_parser if mode is ToolMode.AUTO else None
        return OutputPlan(mode, parser, name, is_parallel, reasoning, constraint)


class NamedCallParser(ToolParser):
    """A named choice's reply: the whole text is the arguments of that one function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._has_begun = False

    def push(self, text: str) -> ParsedDelta:
        if self._has_begun:
            return ParsedDelta(tool_calls=[ToolCallDelta(0, text)] if text else None)
        self._has_begun = True
        return ParsedDelta(tool_calls=[ToolCallDelta(0, text, self.name, new_tool_call_id())])

    def finish(self) -> ParsedDelta:
        return self.push("") if not self._has_begun else ParsedDelta()


def _tool_parser(plan: OutputPlan) -> ToolParser | None:
    match plan.tool_mode:
        case ToolMode.AUTO:
            assert plan.tool_call_parser is not None  # ChatParsing plans AUTO with a parser
            return TOOL_PARSERS[plan.tool_call_parser]()
        case ToolMode.REQUIRED:
            return JsonArrayToolParser(None, (REQUIRED_ARGUMENTS_KEY, "arguments"))
        case ToolMode.NAMED:
            assert plan.function_name is not None
            return NamedCallParser(plan.function_name)
        case None:
            return None


class ChatOutputParser:
    """One choice's text as reasoning, content and tool calls. `delta` parses a stream piece by
    piece; `message` parses a whole reply. Either way the calls are numbered from 0 and, when
    the request forbids parallel calls, only the first is kept."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self._reasoning = (
            None if plan.reasoning_parser is None else ReasoningParser(plan.reasoning_parser)
        )
        self._tools = _tool_parser(plan)
        self.has_tool_calls = False

    def _parse(self, text: str, is_last: bool) -> tuple[str, ParsedDelta]:
        """The reasoning and the parsed content of the next piece of text."""
        split = ReasoningDelta("", text)
        if self._reasoning is not None:
            split = self._reasoning.push(text)
            if is_last:
                rest = self._reasoning.finish()
                split = ReasoningDelta(
                    split.reasoning + rest.reasoning, split.content + rest.content
                )
        parsed = ParsedDelta(split.content)
        if self._tools is not None:
            parsed = self._tools.push(split.content)
            if is_last:
                parsed.add(self._tools.finish())
        if parsed.tool_calls and not self.plan.is_parallel:
            parsed.tool_calls = [call for call in parsed.tool_calls if call.index == 0] or None
        self.has_tool_calls = self.has_tool_calls or bool(parsed.tool_calls)
        return split.reasoning, parsed

    def delta(self, text: str, is_last: bool) -> JsonObject:
        """A stream chunk's delta for the next piece of text (`is_last`: the reply has ended)."""
        reasoning, parsed = self._parse(text, is_last)
        delta: JsonObject = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = _merged(parsed.tool_calls)
        return delta

    def message(self, text: str) -> JsonObject:
        """A whole reply's message."""
        reasoning, parsed = self._parse(text, is_last=True)
        calls = _merged(parsed.tool_calls or [])
        has_more = bool(calls or reasoning)
        message: JsonObject = {
            "role": "assistant",
            "content": parsed.content or (None if has_more else ""),
        }
        if self._reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if calls:
            message["tool_calls"] = [
                {key: value for key, value in call.items() if key != "index"} for call in calls
            ]
        return message

    def finish_reason(self, reason: str) -> str:
        """OpenAI's reason for a reply that called tools: "tool_calls" where it stopped."""
        return "tool_calls" if self.has_tool_calls and reason == "stop" else reason


def _merged(deltas: list[ToolCallDelta]) -> list[JsonObject]:
    """The deltas of one chunk (or a whole reply) in OpenAI's shape, one entry per call."""
    calls: dict[int, JsonObject] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = delta.openai()
        else:
            function = call["function"]
            assert isinstance(function, dict)
            function["arguments"] += delta.arguments
    return list(calls.values())
