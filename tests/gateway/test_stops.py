from hypothesis import given
from hypothesis import strategies as st

from services.gateway.pipeline.stops import StopHoldback, StopSequenceMatcher


def test_match_inside_one_chunk():
    matcher = StopSequenceMatcher(["world"])
    assert matcher.feed("hello ") is None
    assert matcher.feed("world, again") == len("hello world")


def test_match_across_chunks():
    matcher = StopSequenceMatcher(["\n\n", "END"])
    assert matcher.feed("abc E") is None
    assert matcher.feed("N") is None
    assert matcher.feed("Dxyz") == len("abc END")


def test_old_match_not_reported_again_and_earliest_wins():
    matcher = StopSequenceMatcher(["ab", "b c"])
    assert matcher.feed("xx ab") == 5
    # "b c" spans the old and the new text and ends (at 7) before the new "ab" (at 10)
    assert matcher.feed(" c ab") == 7


def test_no_stops():
    matcher = StopSequenceMatcher([])
    assert matcher.feed("anything") is None


def shown_pieces(stops: list[str], pieces: list[str], text_before_stop: str) -> list[str]:
    holdback = StopHoldback(stops)
    shown = [holdback.push(piece) for piece in pieces[:-1]]
    return [*shown, holdback.finish(Ended(text_before_stop))]


class Ended:
    def __init__(self, text: str):
        self.text_before_stop = text


def test_holdback_never_shows_a_stop_string_or_its_start():
    # "sat on" arrives over three tokens; its start waits until the match is decided
    pieces = [" the cat", " sa", "t o", "n the"]
    shown = shown_pieces(["sat on"], pieces, " the cat ")
    assert shown == [" the cat", " ", "", ""] and "".join(shown) == " the cat "
    # a start that turns out not to be the stop is shown as soon as that is known
    holdback = StopHoldback(["sat on"])
    assert holdback.push(" sa") == " "
    assert holdback.push("nd") == "sand"
    assert holdback.push(" sat") == " "
    assert holdback.finish(Ended(" sand sat")) == "sat"  # ended without the stop (length)


def test_holdback_without_stops_shows_everything_at_once():
    holdback = StopHoldback([])
    assert holdback.push("abc") == "abc" and holdback.finish(Ended("abcdef")) == "def"


@given(
    text=st.text(alphabet="ab c", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_holdback_shows_exactly_the_text_before_the_first_stop(text, stops, cuts):
    """Any tokenization of any text: what is shown is the text up to the earliest stop match
    (the matcher's), never more at any moment."""
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher, holdback, shown, end = StopSequenceMatcher(stops), StopHoldback(stops), "", None
    for piece in pieces:
        end = matcher.feed(piece)
        if end is not None:
            break
        shown += holdback.push(piece)
    before = matcher.text if end is None else matcher.text[: end - len(matcher.matched)]
    assert before.startswith(shown)
    assert shown + holdback.finish(Ended(before)) == before
