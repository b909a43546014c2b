"""StopStringMatcher: ends a choice's text before the first stop string, as OpenAI does, and holds
back the tail of streamed text that could still grow into one, so no client ever sees part of a
stop string. It only looks at text; the caller aborts the engine request on a match.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    """What one piece of text let through, and whether a stop string ended the choice."""

    text: str
    is_stopped: bool


class StopStringMatcher:
    """Matches one choice's text against its stop strings as the text grows.

    Invariant: `_held` contains no stop string, and is the longest tail of the text seen so far
    that is a proper prefix of some stop string (held back until the text decides it).
    """

    def __init__(self, stops: list[str], is_stop_shown: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("an empty stop string: expected at least one character")
        self.stops = stops
        self.is_stop_shown = is_stop_shown  # vLLM's include_stop_str_in_output
        self._held = ""
        self.is_stopped = False

    def push(self, text: str, can_stop: bool = True) -> StopMatch:
        """The text that is now certain to be shown; once stopped, nothing more. With `can_stop`
        False (min_tokens not yet reached) everything passes, held text included."""
        if self.is_stopped:
            return StopMatch("", True)
        window = self._held + text
        if not self.stops or not can_stop:
            self._held = ""
            return StopMatch(window, False)
        matches = [(idx, stop) for stop in self.stops if (idx := window.find(stop)) >= 0]
        if matches:  # the earliest; of two starting there, the longer (it was shown whole)
            first, stop = min(matches, key=lambda match: (match[0], -len(match[1])))
            self.is_stopped = True
            self._held = ""
            end = first + len(stop) if self.is_stop_shown else first
            return StopMatch(window[:end], True)
        num_held = self._num_possible_start(window)
        self._held = window[len(window) - num_held :]
        return StopMatch(window[: len(window) - num_held], False)

    def finish(self) -> str:
        """The held-back tail, once the text has ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _num_possible_start(self, window: str) -> int:
        """Characters at the end of `window` that begin some stop string without completing it."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(window)), longest, -1):
                if window.endswith(stop[:size]):
                    longest = size
                    break
        return longest
