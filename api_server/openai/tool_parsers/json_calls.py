"""The formats whose calls are bare JSON after an optional tag: JsonArrayToolParser (as
MistralToolParser, `[TOOL_CALLS][{...}, ...]`; with no tag, the array that tool_choice
"required" constrains a reply to) and Llama3JsonToolParser (`<|python_tag|>{...}; {...}`, or a
reply that opens with `{`). Text before the calls is content; so is text after them, unless blank.
"""

from api_server.openai.tool_parsers.tool_parser import (
    STABLE,
    CallAssembler,
    ContentScanner,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    json_value_end,
    loads_final,
    loads_partial,
)


class _Tail:
    """The text after the calls: content, but blank text there is dropped."""

    def __init__(self, is_shown: bool = False) -> None:
        self._pending = ""
        self._is_shown = is_shown  # true once content has shown: nothing more is dropped

    def push(self, text: str) -> str:
        if self._is_shown:
            return text
        self._pending += text
        if not self._pending.strip():
            return ""
        self._is_shown = True
        shown, self._pending = self._pending, ""
        return shown


class JsonArrayToolParser(ToolParser):
    """Calls as one JSON array of `{"name": ..., KEY: {...}}` objects after `tag`; with no tag,
    the reply itself is the array (or, when it does not open with `[`, content).

    Invariant: `_region` is None until the tag has come, and `_calls[i]` parses element i."""

    def __init__(self, tag: str | None, arguments_keys: tuple[str, ...]) -> None:
        self.tag = tag
        self.arguments_keys = arguments_keys
        self._scanner = ContentScanner(tag, None if tag else "[")
        self._region: str | None = None  # the text after the tag (or the reply's opening blank)
        self._calls: list[CallAssembler] = []
        self._num_begun = 0
        self._tail: _Tail | None = None  # set once the array has closed

    def push(self, text: str) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._tail is not None:
            parsed.content += self._tail.push(text)
            return parsed
        if self._region is None:
            content, after = self._scanner.push(text)
            parsed.content += content
            if after is None:
                return parsed
            self._region, text = "", after
        self._region += text
        region = self._region.lstrip()
        if not region:
            return parsed
        if not region.startswith("["):  # no array after the tag: no calls
            parsed.content += (self.tag or "") + self._region
            self._tail = _Tail(is_shown=True)
            return parsed
        end = json_value_end(region, 0)
        if end is None:
            elements = loads_partial(region, STABLE)
            if isinstance(elements, list):
                parsed.tool_calls = self._update(elements)
            return parsed
        num_blank = len(self._region) - len(region)
        self._complete(region[:end], self._region[: num_blank + end], parsed)
        self._tail = _Tail(is_shown=self._num_begun == 0)  # after content, nothing is dropped
        parsed.content += self._tail.push(region[end:])
        return parsed

    def _call(self, position: int) -> CallAssembler:
        while len(self._calls) <= position:
            self._calls.append(CallAssembler(self._num_begun, self.arguments_keys))
        call = self._calls[position]
        if not call.has_begun:
            call.index = self._num_begun  # calls are numbered as they begin
        return call

    def _update(self, elements: list) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for position, element in enumerate(elements):
            call = self._call(position)
            was_begun = call.has_begun
            deltas += call.update_value(element)
            self._num_begun += call.has_begun and not was_begun
        return deltas

    def _complete(self, array_text: str, text: str, parsed: ParsedDelta) -> None:
        """The last deltas of every element; an array with no call in it is content (the tag
        and `text`, the array as written)."""
        elements = loads_final(array_text)
        if not isinstance(elements, list):
            elements = []
        deltas: list[ToolCallDelta] = []
        for position, element in enumerate(elements):
            call = self._call(position)
            was_begun = call.has_begun
            deltas += call.complete_value(element) or []
            self._num_begun += call.has_begun and not was_begun
        if self._num_begun == 0:
            parsed.content += (self.tag or "") + text
        else:
            parsed.tool_calls = (parsed.tool_calls or []) + deltas

    def finish(self) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._tail is not None:
            return parsed  # blank text after the calls is dropped
        if self._region is None:
            parsed.content += self._scanner.finish()
        elif self._region.strip():  # the reply ended inside the array
            self._complete(self._region.lstrip(), self._region, parsed)
        else:  # the tag and blank text: no calls
            parsed.content += (self.tag or "") + self._region
        return parsed


class MistralToolParser(JsonArrayToolParser):
    """`[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`; the tag is a
    special token, so the text must keep special tokens."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__("[TOOL_CALLS]", ("arguments", "parameters"))


class Llama3JsonToolParser(ToolParser):
    """Calls as JSON objects `{"name": ..., "parameters": {...}}` separated by `;`, after
    `<|python_tag|>` or opening the reply. A first object that is no call is content, as is
    whatever follows the last call.

    Invariant: `_pending` is None until the calls have begun; then it holds the text of the
    object being parsed, or the blank text after one."""

    TAG = "<|python_tag|>"
    ARGUMENTS_KEYS = ("parameters", "arguments")
    needs_special_tokens = True  # the tag is one of Llama 3's special tokens

    def __init__(self) -> None:
        self._scanner = ContentScanner(self.TAG, "{")
        self._pending: str | None = None
        self._call: CallAssembler | None = None  # the object being parsed
        self._num_calls = 0
        self._tail: _Tail | None = None  # set once the calls have ended

    def push(self, text: str) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._pending is None and self._tail is None:
            content, after = self._scanner.push(text)
            parsed.content += content
            if after is None:
                return parsed
            self._pending, text = "", after
        if self._tail is not None:
            parsed.content += self._tail.push(text)
            return parsed
        self._pending = (self._pending or "") + text
        self._parse_pending(parsed, is_final=False)
        return parsed

    def _parse_pending(self, parsed: ParsedDelta, is_final: bool) -> None:
        """Consumes whole objects and separators from `_pending`."""
        while self._tail is None:
            text = (self._pending or "").lstrip()
            if self._call is None:  # between objects
                if self._num_calls and text.startswith(";"):
                    text = text[1:].lstrip()
                elif self._num_calls and text:
                    self._end(text, parsed)
                    return
                if not text:
                    return
                if not text.startswith("{"):
                    self._end(text, parsed)
                    return
                self._call = CallAssembler(self._num_calls, self.ARGUMENTS_KEYS)
            end = json_value_end(text, 0)
            if end is None and not is_final:
                self._pending = text
                parsed.tool_calls = (parsed.tool_calls or []) + self._call.update(text)
                return
            object_text = text if end is None else text[:end]
            deltas = self._call.complete(object_text)
            if deltas is None:  # no call: it and all after it is content
                self._end(text, parsed)
                return
            parsed.tool_calls = (parsed.tool_calls or []) + deltas
            self._num_calls += 1
            self._call = None
            self._pending = "" if end is None else text[end:]
            if end is None:
                return

    def _end(self, text: str, parsed: ParsedDelta) -> None:
        """The calls are over: `text` and all that follows is content."""
        if self._num_calls == 0 and self._scanner.has_found_tag:
            text = self.TAG + text
        self._tail = _Tail(is_shown=True)
        parsed.content += text
        self._pending, self._call = None, None

    def finish(self) -> ParsedDelta:
        parsed = ParsedDelta()
        if self._tail is not None:
            return parsed
        if self._pending is None:
            parsed.content += self._scanner.finish()
        else:
            self._parse_pending(parsed, is_final=True)
        return parsed
