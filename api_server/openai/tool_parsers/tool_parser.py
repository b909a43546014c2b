"""ToolParser: the incremental parse of a model's text into content and tool calls, shared by
every format. Text is pushed as it is detokenized; each push returns the deltas that are now
certain. A whole reply is one push and finish, so a stream's deltas always add up to it.
"""

import json
import os
from dataclasses import dataclass

import partial_json_parser
from partial_json_parser import Allow

# Only containers may be left open in a stable parse: a string or number at the end of the text
# may still grow, so it is left out until it is complete
STABLE = Allow.OBJ | Allow.ARR
CLOSERS = "}]"


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one call in OpenAI's delta shape: the first piece of call `index` carries its
    id and name, the later ones pieces of its JSON arguments."""

    index: int
    arguments: str
    name: str | None = None  # set on the first piece only
    id: str | None = None  # set on the first piece only: "call_" and 24 hex digits

    def openai(self) -> dict:
        function: dict = {"arguments": self.arguments}
        if self.name is None:
            return {"index": self.index, "function": function}
        function = {"name": self.name, **function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class ParsedDelta:
    """What one push adds: content text, and pieces of tool calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] | None = None

    def add(self, other: "ParsedDelta") -> None:
        self.content += other.content
        if other.tool_calls:
            self.tool_calls = (self.tool_calls or []) + other.tool_calls


def new_tool_call_id() -> str:
    return f"call_{os.urandom(12).hex()}"


def held_prefix_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: text that must wait, since
    it may still become the tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at text[start], or None while it
    is still open. Brackets inside strings do not count."""
    depth, is_in_string, is_escaped = 0, False, False
    for idx in range(start, len(text)):
        char = text[idx]
        if is_in_string:
            if is_escaped:
                is_escaped = False
            elif char == "\\":
                is_escaped = True
            elif char == '"':
                is_in_string = False
        elif char == '"':
            is_in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return idx + 1
    return None


def loads_partial(text: str, allow: Allow) -> object | None:
    """The value a JSON prefix parses to, its open containers closed; None if it is not one."""
    try:
        return partial_json_parser.loads(text, allow)
    except (ValueError, partial_json_parser.core.exceptions.PartialJSON):
        return None  # MalformedJSON and JSONDecodeError are ValueErrors


def loads_final(text: str) -> object | None:
    """The value of a finished JSON text; a text the output's end cut short is closed."""
    try:
        return json.loads(text)
    except ValueError:
        return loads_partial(text, Allow.ALL)


def dumps(value: object) -> str:
    """Arguments as OpenAI clients get them: JSON with the characters unescaped, as vLLM sends."""
    return json.dumps(value, ensure_ascii=False)


class CallAssembler:
    """One tool call being parsed from its JSON object's text, `{"name": ..., KEY: {...}}` with
    KEY one of `arguments_keys`.

    The call begins (its first delta, with id and name) once the name is a complete string;
    until then its text is not known to be a call. Argument pieces follow as the stable parse
    of the arguments grows: its JSON text with the closing brackets the parser added left off,
    which every later text begins with. The final text is the complete parse's.

    Invariant: `sent` begins every arguments text this call can still end with, except when
    the object repeats a key (the later value wins and what was sent cannot be taken back)."""

    def __init__(self, index: int, arguments_keys: tuple[str, ...]) -> None:
        self.index = index
        self.arguments_keys = arguments_keys
        self.name: str | None = None
        self.sent = ""  # the arguments text sent so far
        self._last_arguments: object = None  # the last stable parse of the arguments

    @property
    def has_begun(self) -> bool:
        return self.name is not None

    def _arguments(self, value: object) -> object:
        assert isinstance(value, dict)
        return next((value[key] for key in self.arguments_keys if key in value), None)

    def _begin(self, value: object) -> list[ToolCallDelta]:
        if self.name is not None:
            return []
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str):
            return []
        self.name = name
        return [ToolCallDelta(self.index, "", name, new_tool_call_id())]

    def update(self, text: str) -> list[ToolCallDelta]:
        """The deltas that the object's text so far makes certain."""
        return self.update_value(loads_partial(text, STABLE))

    def update_value(self, value: object) -> list[ToolCallDelta]:
        """The deltas that a stable parse of the object so far makes certain."""
        deltas = self._begin(value)
        if self.name is None:
            return deltas
        assert isinstance(value, dict)
        arguments = self._arguments(value)
        if arguments is None:
            return deltas
        self._last_arguments = arguments
        stable = dumps(arguments).rstrip(CLOSERS)
        if len(stable) > len(self.sent) and stable.startswith(self.sent):
            deltas.append(ToolCallDelta(self.index, stable[len(self.sent) :]))
            self.sent = stable
        return deltas

    def complete(self, text: str) -> list[ToolCallDelta] | None:
        """The last deltas of the call whose object's text is all here; None if it is no call
        (it never had a name: its text stays content)."""
        return self.complete_value(loads_final(text))

    def complete_value(self, value: object) -> list[ToolCallDelta] | None:
        """As complete, from the object's complete parse (None: the text is no JSON)."""
        deltas = self._begin(value)
        if self.name is None:
            return None
        if isinstance(value, dict) and value.get("name") == self.name:
            arguments = self._arguments(value)
        else:  # the text broke after the name was sent: the arguments parsed before the break
            arguments = self._last_arguments
        final = dumps({} if arguments is None else arguments)
        rest = final[len(self.sent) :] if final.startswith(self.sent) else ""
        if rest:
            deltas.append(ToolCallDelta(self.index, rest))
        self.sent += rest
        return deltas


class ContentScanner:
    """The content before a format's calls: text until `tag` or, when the reply opens (after
    blank text) with `opener`, nothing. Text that may still begin the tag is held back."""

    def __init__(self, tag: str | None, opener: str | None) -> None:
        self.tag = tag
        self.opener = opener  # a bracket that, first in the reply, begins the calls
        self._pending = ""
        self._is_at_start = opener is not None
        self.has_found_tag = False  # the calls began at the tag, not at the opener

    def push(self, text: str) -> tuple[str, str | None]:
        """The content now certain, and the text after the calls' start (None until found)."""
        buffer = self._pending + text
        self._pending = ""
        if self._is_at_start:
            stripped = buffer.lstrip()
            if not stripped:
                self._pending = buffer
                return "", None
            self._is_at_start = False
            if stripped[0] == self.opener:
                return "", stripped
        if self.tag is None:
            return buffer, None
        idx = buffer.find(self.tag)
        if idx >= 0:
            self.has_found_tag = True
            return buffer[:idx], buffer[idx + len(self.tag) :]
        num_held = held_prefix_len(buffer, self.tag)
        self._pending = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], None

    def finish(self) -> str:
        rest, self._pending = self._pending, ""
        return rest


class ToolParser:
    """The parse of one choice's text. `push` takes the next piece and returns what is certain;
    `finish` says the text has ended and returns the rest. Subclasses hold text back while it
    may still be the start of a call."""

    # Formats whose tags are special tokens need them in the text (skip_special_tokens false)
    needs_special_tokens = False

    def push(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedDelta:
        """A whole reply's content and call pieces: one push and the finish."""
        parsed = self.push(text)
        parsed.add(self.finish())
        return parsed
