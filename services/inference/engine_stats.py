"""A snapshot of the engine for the Stats RPC and the metrics (no torch work to read it), and
the distributions of its steps (time and tokens) that the metrics read at scrape time."""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass

from services.inference.kv_cache import KVCache
from services.inference.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The batch, the queue, the KV cache and the totals since the engine was built."""

    num_running: int
    num_waiting: int
    kv_total_bytes: int
    kv_used_bytes: int
    kv_free_bytes: int
    prefix_lookups: int
    prefix_hits: int
    prefix_hit_tokens: int
    num_steps: int
    num_generated_tokens: int
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_requests: int
    """Generations queued since start (health probes are not generations)."""
    num_step_errors: int
    """Steps that failed since start (each failed the requests it computed)."""


def engine_stats(scheduler: Scheduler, cache: KVCache, num_steps: int, num_generated_tokens: int,
                 num_requests: int, num_step_errors: int) -> EngineStats:
    """The snapshot of ``scheduler`` and ``cache`` and the engine's own totals (the caller
    holds the engine lock)."""
    s, prefix = scheduler, scheduler.prefix
    used = cache.used_bytes(s.num_running, prefix.num_used_blocks if prefix else 0)
    return EngineStats(
        s.num_running, s.num_waiting, cache.total_bytes, used, cache.total_bytes - used,
        prefix.num_lookups if prefix else 0, prefix.num_hits if prefix else 0,
        prefix.num_hit_tokens if prefix else 0, num_steps, num_generated_tokens, s.num_preemptions,
        s.num_draft_tokens, s.num_accepted_tokens, num_requests, num_step_errors)


STEP_SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds of the step time histogram: a decode step of a small model on a GPU takes
milliseconds, the first step of a large prefill batch on a loaded CPU seconds."""
STEP_TOKENS_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Upper bounds of the tokens-per-step histogram (decode steps: about one per sequence;
prefill chunks: up to the scheduler's token budget)."""


@dataclass(frozen=True, slots=True)
class Distribution:
    """Observations in Prometheus histogram form: ``cumulative[i]`` are those <= ``bounds[i]``
    (the last entry, one past the bounds, counts them all), and their sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class _Counts:
    """Observations per bucket (not thread-safe: ``StepStats`` holds the lock)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.per_bucket = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.per_bucket[bisect_left(self.bounds, value)] += 1
        self.total += value

    def distribution(self) -> Distribution:
        cumulative, running = [], 0
        for n in self.per_bucket:
            running += n
            cumulative.append(running)
        return Distribution(self.bounds, tuple(cumulative), self.total)


class StepStats:
    """The time and the tokens of every engine step. The engine's worker records each step
    (one call, under the engine lock); a scrape reads the distributions from another thread,
    so they have a small lock of their own and a scrape never waits on the engine lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = _Counts(STEP_SECONDS_BOUNDS)
        self._tokens = _Counts(STEP_TOKENS_BOUNDS)

    def record(self, elapsed_s: float, num_tokens: int) -> None:
        """One step's execution took ``elapsed_s`` (inputs, forward and sampling) and computed
        ``num_tokens`` (prompt chunks, decode tokens and drafts)."""
        with self._lock:
            self._seconds.observe(elapsed_s)
            self._tokens.observe(num_tokens)

    def seconds(self) -> Distribution:
        with self._lock:
            return self._seconds.distribution()

    def tokens(self) -> Distribution:
        with self._lock:
            return self._tokens.distribution()
