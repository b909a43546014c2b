"""Tool parsers: each turns a model's text into content and OpenAI tool calls, whole or as
stream deltas (--tool-call-parser names one)."""

from api_server.openai.tool_parsers.hermes import HermesToolParser
from api_server.openai.tool_parsers.json_calls import Llama3JsonToolParser, MistralToolParser
from api_server.openai.tool_parsers.tool_parser import ParsedDelta, ToolCallDelta, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCallDelta", "ToolParser"]
