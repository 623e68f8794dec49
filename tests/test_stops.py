"""Stop strings over streamed text: the output equals cutting the whole text at the first stop."""
from __future__ import annotations

from hypothesis import given, strategies as st

from lever_actors.stops import StopScanner

CHUNKS = st.lists(st.text(alphabet="ab<>/é", max_size=4), max_size=12)
STOPS = st.lists(st.text(alphabet="ab<>/é", min_size=1, max_size=4), max_size=3)


def cut_at_first_stop(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """The reference: after each chunk, look for a complete stop in everything so far."""
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], True
    return text, False


def stream(chunks: list[str], stops: list[str]) -> tuple[list[str], bool]:
    scanner = StopScanner(stops)
    out = [scanner.feed(c) for c in chunks]
    out.append(scanner.flush())
    return out, scanner.stopped


@given(CHUNKS, STOPS)
def test_streamed_output_equals_the_text_cut_at_the_first_complete_stop(chunks, stops):
    out, stopped = stream(chunks, stops)
    assert ("".join(out), stopped) == cut_at_first_stop(chunks, stops)


@given(CHUNKS, STOPS, CHUNKS)
def test_nothing_released_is_ever_taken_back_by_what_follows(chunks, stops, more):
    """What was sent after ``chunks`` is a prefix of the output whatever text comes next."""
    scanner = StopScanner(stops)
    sent = "".join(scanner.feed(c) for c in chunks)
    final, _ = cut_at_first_stop(chunks + more, stops)
    assert final.startswith(sent)


def test_a_stop_split_across_chunks_is_held_back_then_dropped():
    scanner = StopScanner(["</code>"])
    assert scanner.feed("x = 1<") == "x = 1"
    assert scanner.feed("/co") == ""
    assert scanner.feed("de> tail") == ""
    assert scanner.stopped and scanner.flush() == ""


def test_a_held_prefix_that_does_not_become_a_stop_is_released():
    scanner = StopScanner(["</code>"])
    assert scanner.feed("a </") == "a "
    assert scanner.feed("div>") == "</div>"
    assert scanner.feed("<") == ""
    assert scanner.flush() == "<" and not scanner.stopped
