"""Tool parsers: each turns a model's text into content and OpenAI tool calls, whole or as
stream deltas (--tool-call-parser names one)."""

from collections.abc import Callable

from api_server.tool_parsers.hermes import HermesToolParser
from api_server.tool_parsers.json_calls import JsonArrayToolParser, Llama3JsonToolParser
from api_server.tool_parsers.tool_parser import ParsedDelta, ToolCallDelta, ToolParser


class MistralToolParser(JsonArrayToolParser):
    """`[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`; the tag is a
    special token, so the text must keep special tokens."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__("[TOOL_CALLS]", ("arguments", "parameters"))


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCallDelta", "ToolParser"]
