"""The engine's hand-off types: ``GenerateRequest`` in, ``TokenEvent`` out (token ids only)."""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.finish import FinishReason
from services.inference.grammar import JsonConstraint
from services.inference.sampler import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs

__all__ = ["MAX_TOP_LOGPROBS", "GenerateRequest", "TokenEvent", "TokenLogprobs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    """One generation, in token ids (keyword-only fields). ``deadline``: ``time.monotonic()``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    """Higher waits less: the queue is ordered by priority, then arrival."""
    deadline: float | None = None
    """Past it while still queued: DeadlineExceeded, and the request never runs."""
    top_logprobs: int | None = None
    """None: no log-probabilities (nothing is computed); N: each token's, and the N most likely
    alternatives' (0..MAX_TOP_LOGPROBS), at each step (``sampler.token_logprobs``)."""
    constraint: JsonConstraint | None = None
    """Constrained decoding (grammar.py); None = free text."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New ids of one request; the last event has ``finish_reason`` set.

    Counters are running totals on every event, final on the last one (so a caller that stops
    reading early still holds them). An engine failure is raised from ``generate`` (never sent
    as an event), so "error" is reserved for batch-level reporting.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    compute_ms: float
    kv_peak_bytes: int = 0
    """Most KV bytes this request's tokens held at once (tokens x bytes per token)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per id of ``token_ids`` when the request asked for them; otherwise empty."""
