"""Each model version's finished requests over a rolling window, and the figures made from them.

The gateway records every finished request under the version that served it (``record``) and
every rating under the version that answered (``record_feedback``); ``figures(model)`` gives
what the Admin service reports as ``VersionFigures`` and what the canary judgement compares
(``canary_judge.py``, docs/rollouts.md). Entries older than ``window_s`` fall out; each version
keeps at most ``max_entries`` requests and as many ratings (the newest), so memory stays bounded
however busy it is. Latency percentiles are over the requests the model itself served: a cache
hit's first token measures the cache, and a new version starts with a cold cache, so hits would
make the older version look faster (docs/decisions.md, decision 50).

Pure Python, no grpc, no pb; one event loop calls it (not thread-safe). The clock is injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from services.gateway.domain import VersionFigures

DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_ENTRIES = 10_000
"""Requests (and ratings) kept per version: 33 a second over a 300 s window."""


class _Timed(Protocol):
    @property
    def at(self) -> float: ...


T = TypeVar("T", bound=_Timed)


@dataclass(frozen=True, slots=True)
class _Finished:
    at: float
    ttft_ms: float | None
    tpot_ms: float | None
    is_error: bool
    cache_hit: bool
    cost_micros: int


@dataclass(frozen=True, slots=True)
class _Rating:
    at: float
    negative: bool


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of ascending values (a value that was seen); 0.0 for none."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return float(sorted_values[rank - 1])


class VersionWindow:
    """Finished requests and ratings per model version (``name@version``), newest last."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_entries < 1:
            raise ValueError(f"window_s must be > 0 and max_entries >= 1, got {window_s}, {max_entries}")
        self.window_s, self.max_entries, self._clock = window_s, max_entries, clock
        self._finished: dict[str, deque[_Finished]] = {}
        self._ratings: dict[str, deque[_Rating]] = {}

    def record(self, model: str, ended_at: float, ttft_ms: float | None, tpot_ms: float | None,
               is_error: bool, cache_hit: bool, cost_micros: int) -> None:
        """One finished request of ``model``, ended at ``ended_at`` (the clock's time).

        ``ttft_ms``: None when it produced no token; ``tpot_ms``: None with fewer than two tokens.
        ``is_error``: it ended with a server-side error (a client's own errors are not recorded as
        errors: they are not the version's)."""
        entries = self._finished.setdefault(model, deque(maxlen=self.max_entries))
        entries.append(_Finished(ended_at, ttft_ms, tpot_ms, is_error, cache_hit, cost_micros))
        self._prune(entries, ended_at)

    def record_feedback(self, model: str, negative: bool, at: float | None = None) -> None:
        """One rating of an answer ``model`` gave: negative (bad) or not."""
        at = self._clock() if at is None else at
        ratings = self._ratings.setdefault(model, deque(maxlen=self.max_entries))
        ratings.append(_Rating(at, negative))
        self._prune(ratings, at)

    def forget(self, model: str) -> None:
        """Drop a version that left its route."""
        self._finished.pop(model, None)
        self._ratings.pop(model, None)

    def figures(self, model: str, now: float | None = None) -> VersionFigures:
        """``model``'s figures over ``(now - window_s, now]``; all zero for a version never seen."""
        now = self._clock() if now is None else now
        start = now - self.window_s
        finished = [f for f in self._finished.get(model, ()) if start < f.at <= now]
        ratings = [r.negative for r in self._ratings.get(model, ()) if start < r.at <= now]
        served = [f for f in finished if not f.cache_hit]
        ttft = sorted(f.ttft_ms for f in served if f.ttft_ms is not None)
        tpot = sorted(f.tpot_ms for f in served if f.tpot_ms is not None)
        count = len(finished)
        return VersionFigures(
            window_s=self.window_s, requests=count,
            error_rate=_share(sum(f.is_error for f in finished), count),
            ttft_p50_ms=percentile(ttft, 0.50), ttft_p95_ms=percentile(ttft, 0.95),
            tpot_p50_ms=percentile(tpot, 0.50), tpot_p95_ms=percentile(tpot, 0.95),
            cache_hit_rate=_share(count - len(served), count),
            mean_cost_micros=_share(sum(f.cost_micros for f in finished), count),
            negative_feedback_rate=_share(sum(ratings), len(ratings)),
            ttft_samples=len(ttft), tpot_samples=len(tpot),
        )

    def _prune(self, entries: deque[T], now: float) -> None:
        """Drop the oldest entries that fell out of the window."""
        start = now - self.window_s
        while entries and entries[0].at <= start:
            entries.popleft()


def _share(part: float, whole: int) -> float:
    return part / whole if whole else 0.0
