from services.gateway.stops import StopMatcher


def _run(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(d) for d in deltas) + matcher.flush()
    return out, matcher.stopped


def test_no_stop_strings_passes_text_through() -> None:
    assert _run((), ["a", "b"]) == ("ab", False)


def test_stop_string_inside_one_delta_is_cut() -> None:
    assert _run(("END",), ["hello END world"]) == ("hello ", True)


def test_stop_string_split_across_deltas_is_never_leaked() -> None:
    matcher = StopMatcher(("###",))
    sent = [matcher.feed(d) for d in ["ab#", "#", "#cd"]]
    assert sent == ["ab", "", ""]
    assert matcher.stopped


def test_held_back_prefix_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopMatcher(("###",))
    assert matcher.feed("x#") == "x"
    assert matcher.feed("y") == "#y"
    assert _run(("###",), ["a#", "#"]) == ("a##", False)


def test_earliest_of_several_stops_wins() -> None:
    assert _run(("b", "a"), ["xxab"]) == ("xx", True)


def test_nothing_after_stop() -> None:
    matcher = StopMatcher(("!",))
    assert matcher.feed("hi!") == "hi"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""
