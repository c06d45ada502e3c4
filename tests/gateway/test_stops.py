from services.gateway.stops import StopSequenceMatcher


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
