"""Stop strings, matched on the text as it grows: the text ends before the first match, and a
tail that could still become one is held back until the text decides it."""

import pytest

from api_server.openai.stop_strings import StopStringMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    shown = []
    for piece in pieces:
        match = matcher.push(piece)
        shown.append(match.text)
        if match.is_stopped:
            return shown, True
    shown.append(matcher.finish())
    return shown, False


def test_text_ends_before_a_stop_string_split_across_pieces() -> None:
    shown, is_stopped = _run(["STOP"], ["hello S", "T", "O", "P world"])
    assert is_stopped
    assert shown == ["hello ", "", "", ""]  # S, T, O were held back, never shown


def test_a_held_tail_that_does_not_become_a_stop_string_is_released() -> None:
    shown, is_stopped = _run(["STOP"], ["hello S", "TO", "CK"])
    assert not is_stopped
    assert "".join(shown) == "hello STOCK"
    assert shown[:2] == ["hello ", ""]


def test_the_earliest_of_several_stop_strings_wins() -> None:
    shown, is_stopped = _run(["world", "lo w"], ["hello world"])
    assert (shown, is_stopped) == (["hel"], True)


def test_include_stop_str_in_output_keeps_the_match() -> None:
    matcher = StopStringMatcher(["ST", "STOP"], is_stop_shown=True)
    assert matcher.push("go S").text == "go "
    match = matcher.push("TOP!")
    assert (match.text, match.is_stopped) == ("STOP", True)  # the longer of two at one place


def test_a_stop_string_inside_one_piece_cuts_it() -> None:
    assert _run(["\n"], ["one\ntwo"]) == (["one"], True)


def test_nothing_is_shown_after_a_stop() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.push("ax").is_stopped
    assert matcher.push("more").text == ""
    assert matcher.finish() == ""


def test_before_min_tokens_text_passes_whole() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a STOP b S", can_stop=False).text == "a STOP b S"
    match = matcher.push("TOP")  # the S before was shown: this alone completes nothing
    assert (match.text, match.is_stopped) == ("TOP", False)
    match = matcher.push("! STOP")
    assert (match.text, match.is_stopped) == ("! ", True)


def test_without_stop_strings_text_passes_at_once() -> None:
    assert _run([], ["a", "b"]) == (["a", "b", ""], False)


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty stop string"):
        StopStringMatcher([""])
