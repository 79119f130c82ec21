"""Each version's rolling window: the figures from known requests, entries falling out of the
window, the memory cap, and ratings."""

from __future__ import annotations

import pytest

from services.gateway.version_window import VersionFigures, VersionWindow, percentile

V1, V2 = "m@1", "m@2"


def test_percentiles_are_nearest_rank_of_seen_values() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert (percentile(values, 0.5), percentile(values, 0.95), percentile(values, 1.0)) == (50.0, 95.0, 100.0)
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([], 0.5) == 0.0


def test_figures_of_known_requests() -> None:
    window = VersionWindow(window_s=300)
    for i in range(1, 21):  # ttft 10..200 ms, tpot 1..20 ms, every 5th an error, cost 100 each
        window.record(V1, ended_at=float(i), ttft_ms=10.0 * i, tpot_ms=float(i), is_error=i % 5 == 0,
                      cache_hit=False, cost_micros=100)
    for i in range(5):  # 5 cache hits, instant and free: counted, but not in the latencies
        window.record(V1, ended_at=21.0 + i, ttft_ms=0.5, tpot_ms=0.1, is_error=False, cache_hit=True, cost_micros=0)
    figures = window.figures(V1, now=30.0)
    assert figures.requests == 25
    assert figures.error_rate == pytest.approx(4 / 25)
    assert (figures.ttft_p50_ms, figures.ttft_p95_ms) == (100.0, 190.0)
    assert (figures.tpot_p50_ms, figures.tpot_p95_ms) == (10.0, 19.0)
    assert (figures.ttft_samples, figures.tpot_samples) == (20, 20)
    assert figures.cache_hit_rate == pytest.approx(5 / 25)
    assert figures.mean_cost_micros == pytest.approx(2000 / 25)
    assert figures.window_s == 300
    assert window.figures(V2, now=30.0) == VersionFigures(window_s=300)  # another version: nothing yet


def test_a_request_without_tokens_counts_but_has_no_latency() -> None:
    window = VersionWindow()
    window.record(V1, 1.0, ttft_ms=None, tpot_ms=None, is_error=True, cache_hit=False, cost_micros=0)
    window.record(V1, 2.0, ttft_ms=40.0, tpot_ms=None, is_error=False, cache_hit=False, cost_micros=10)
    figures = window.figures(V1, now=3.0)
    assert (figures.requests, figures.error_rate) == (2, 0.5)
    assert (figures.ttft_samples, figures.ttft_p95_ms, figures.tpot_samples, figures.tpot_p95_ms) == (1, 40.0, 0, 0.0)


def test_old_requests_fall_out_of_the_window() -> None:
    window = VersionWindow(window_s=60)
    window.record(V1, 0.0, 500.0, 50.0, True, False, 1000)
    window.record(V1, 30.0, 100.0, 10.0, False, False, 10)
    assert window.figures(V1, now=59.0).requests == 2
    later = window.figures(V1, now=61.0)  # the first ended 61 s ago
    assert (later.requests, later.error_rate, later.ttft_p95_ms, later.mean_cost_micros) == (1, 0.0, 100.0, 10.0)
    assert window.figures(V1, now=200.0).requests == 0
    assert window.figures(V1, now=20.0).requests == 1  # "now" before a request: not yet in the window


def test_memory_is_capped_per_version_keeping_the_newest() -> None:
    window = VersionWindow(window_s=1e6, max_entries=100)
    for i in range(1000):
        window.record(V1, float(i), float(i), 1.0, False, False, 1)
        window.record_feedback(V1, negative=i >= 990, at=float(i))
    figures = window.figures(V1, now=1000.0)
    assert figures.requests == 100
    assert figures.ttft_p50_ms == 949.0  # of 900..999
    assert figures.negative_feedback_rate == pytest.approx(10 / 100)
    assert len(window._finished[V1]) == 100


def test_recording_drops_entries_that_left_the_window() -> None:
    window = VersionWindow(window_s=10, max_entries=1000)
    for i in range(100):
        window.record(V1, float(i), 1.0, 1.0, False, False, 1)
    assert len(window._finished[V1]) == 10  # not 100: the old ones are gone, not only hidden


def test_negative_feedback_rate_over_the_ratings_in_the_window() -> None:
    now = [0.0]
    window = VersionWindow(window_s=100, clock=lambda: now[0])
    for negative in (True, False, False, False):
        window.record_feedback(V2, negative)
    assert window.figures(V2).negative_feedback_rate == 0.25
    assert window.figures(V1).negative_feedback_rate == 0.0
    now[0] = 50.0
    window.record_feedback(V2, True)
    assert window.figures(V2).negative_feedback_rate == pytest.approx(2 / 5)
    now[0] = 120.0  # the first four are out
    assert window.figures(V2).negative_feedback_rate == 1.0


def test_a_forgotten_version_starts_empty() -> None:
    window = VersionWindow()
    window.record(V1, 1.0, 1.0, 1.0, False, False, 1)
    window.record_feedback(V1, True, at=1.0)
    window.forget(V1)
    window.forget("never@seen")
    assert window.figures(V1, now=2.0) == VersionFigures(window_s=window.window_s)


@pytest.mark.parametrize(("window_s", "max_entries"), [(0, 10), (-1, 10), (10, 0)])
def test_a_window_needs_a_length_and_room(window_s: float, max_entries: int) -> None:
    with pytest.raises(ValueError, match="window_s"):
        VersionWindow(window_s, max_entries)
