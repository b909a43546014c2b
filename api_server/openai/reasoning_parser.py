"""ReasoningParser: splits a thinking model's text into its reasoning (`<think>...</think>`) and
the content after it, whole or as stream deltas (--reasoning-parser qwen3|deepseek_r1). It
never holds back more than a tag's length of text.
"""

from dataclasses import dataclass

from api_server.openai.tool_parsers.tool_parser import held_prefix_len

START_TAG = "<think>"
END_TAG = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """qwen3: the reply reasons only when it opens with `<think>` (with enable_thinking false
    the template closes the thinking in the prompt, so it does not). deepseek_r1: the reply
    opens inside the reasoning, since the template may print `<think>` in the prompt; a
    `<think>` at its start is dropped. Either way the reasoning ends at `</think>`, or with the
    reply when that never comes (a reply cut short while thinking).

    Invariant: `_pending` holds only text that may still begin the tag being looked for."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {name!r}: expected one of {REASONING_PARSERS}")
        self.name = name
        self._is_at_start = True  # nothing seen yet: a start tag may open the reply
        self._is_reasoning = name == "deepseek_r1"
        self._is_done = False  # past the end tag: all is content
        self._pending = ""

    def push(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        if self._is_done:
            delta.content = text
            return delta
        buffer = self._pending + text
        self._pending = ""
        if self._is_at_start:
            if START_TAG.startswith(buffer):
                self._pending = buffer  # it may still be the start tag
                return delta
            self._is_at_start = False
            if buffer.startswith(START_TAG):
                buffer = buffer[len(START_TAG) :]
                self._is_reasoning = True
        if not self._is_reasoning:
            self._is_done = True
            delta.content = buffer
            return delta
        idx = buffer.find(END_TAG)
        if idx >= 0:
            self._is_done = True
            delta.reasoning, delta.content = buffer[:idx], buffer[idx + len(END_TAG) :]
            return delta
        num_held = held_prefix_len(buffer, END_TAG)
        self._pending = buffer[len(buffer) - num_held :]
        delta.reasoning = buffer[: len(buffer) - num_held]
        return delta

    def finish(self) -> ReasoningDelta:
        """What was held back, in the part it was held in."""
        rest, self._pending = self._pending, ""
        return ReasoningDelta(rest, "") if self._is_reasoning else ReasoningDelta("", rest)
