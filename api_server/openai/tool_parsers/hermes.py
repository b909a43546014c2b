"""HermesToolParser: calls written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
Qwen2.5 and Qwen3 write them. Text outside the tags is content; blank text between or after
calls is dropped.
"""

from api_server.openai.tool_parsers.tool_parser import (
    CallAssembler,
    ParsedDelta,
    ToolParser,
    held_prefix_len,
    json_value_end,
)

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
ARGUMENTS_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    """Content until a start tag; then a call's text until its end tag (or the end of the
    reply), parsed as it comes; then content again.

    Invariant: `_body` is not None exactly while inside a call's tags, and `_pending` holds
    only text that may still begin a start tag (or, after a call, blank text)."""

    def __init__(self) -> None:
        self._pending = ""  # content held back
        self._body: str | None = None  # the text of the open call since its start tag
        self._call: CallAssembler | None = None
        self._num_calls = 0

    def push(self, text: str) -> ParsedDelta:
        parsed = ParsedDelta()
        while text:
            if self._body is None:
                text = self._push_content(text, parsed)
            else:
                text = self._push_body(text, parsed)
        return parsed

    def _push_content(self, text: str, parsed: ParsedDelta) -> str:
        """Consumes content up to a start tag; returns the text after the tag."""
        buffer = self._pending + text
        idx = buffer.find(START_TAG)
        if idx < 0:
            num_held = held_prefix_len(buffer, START_TAG)
            shown, self._pending = (
                buffer[: len(buffer) - num_held],
                buffer[len(buffer) - num_held :],
            )
            if self._num_calls and not shown.strip():
                self._pending = shown + self._pending  # blank text after a call may be dropped
            else:
                parsed.content += shown
            return ""
        before = buffer[:idx]
        if before.strip() or not self._num_calls:
            parsed.content += before
        self._pending = ""
        self._body = ""
        self._call = CallAssembler(self._num_calls, ARGUMENTS_KEYS)
        return buffer[idx + len(START_TAG) :]

    def _push_body(self, text: str, parsed: ParsedDelta) -> str:
        """Consumes a call's text up to its end tag; returns the text after the tag."""
        assert self._body is not None and self._call is not None
        body = self._body + text
        idx = body.find(END_TAG)
        if idx >= 0:
            self._end_call(body[:idx], parsed)
            return body[idx + len(END_TAG) :]
        self._body = body
        visible = body[: len(body) - held_prefix_len(body, END_TAG)]
        parsed.tool_calls = (parsed.tool_calls or []) + self._call.update(_object_text(visible))
        return ""

    def _end_call(self, body: str, parsed: ParsedDelta, has_end_tag: bool = True) -> None:
        assert self._call is not None
        deltas = self._call.complete(_object_text(body))
        if deltas is None:  # no call after all: its text, tags and all, is content
            parsed.content += START_TAG + body + (END_TAG if has_end_tag else "")
        else:
            parsed.tool_calls = (parsed.tool_calls or []) + deltas
            self._num_calls += 1
        self._body, self._call = None, None

    def finish(self) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._body is not None:  # the reply ended inside a call
            self._end_call(self._body, parsed, has_end_tag=False)
        elif not (self._num_calls and not self._pending.strip()):
            parsed.content += self._pending
        self._pending = ""
        return parsed


def _object_text(body: str) -> str:
    """The call's JSON object: the body without the blank text before it and whatever follows
    its closing brace."""
    text = body.lstrip()
    if not text.startswith("{"):
        return text
    end = json_value_end(text, 0)
    return text if end is None else text[:end]
