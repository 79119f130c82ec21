"""A snapshot of the engine for the Stats RPC and the metrics (no torch work to read it)."""

from __future__ import annotations

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
