"""The engine's record of one request, and how its events reach the caller's event loop.

The worker thread makes the events; each goes back to the loop the request came from with
``call_soon_threadsafe``, a whole step's events in one wake-up per loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiserve.common.finish import FinishReason
from aiserve.common.logging import get_logger
from services.inference.request import GenerateRequest, TokenEvent, TokenLogprobs
from services.inference.runner import RowSampling
from services.inference.sequence import Seq

log = get_logger("batch_engine")

Deliver = Callable[[TokenEvent | BaseException], None]
"""Receives a request's events on its loop's thread, then once the last one or an error."""


@dataclass(eq=False)
class RequestRecord:
    """Engine-side state of one request: where its events go and how it samples."""

    request: GenerateRequest
    seq: Seq
    sampling: RowSampling
    loop: asyncio.AbstractEventLoop
    deliver: Deliver
    context: contextvars.Context
    """The submitter's context, which ``deliver`` runs in (its log lines keep their bindings)."""
    bytes_per_token: int
    """KV bytes one token of this model takes (K and V of every layer)."""
    compute_s: float = 0.0
    """Seconds of the steps this request was part of."""
    peak_tokens: int = 0
    """Most tokens whose K/V this request held at once."""

    def post(self, item: TokenEvent | BaseException) -> None:
        """Hand one event (or the error that ends the request) to the caller's loop."""
        post_all([(self, item)])

    def event(self, token_ids: tuple[int, ...], reason: FinishReason | None,
              logprobs: tuple[TokenLogprobs, ...] = ()) -> TokenEvent:
        """The event carrying ``token_ids`` (and their ``logprobs``, when asked), with the
        request's counters as of now."""
        seq = self.seq
        queued_s = (seq.first_scheduled or time.monotonic()) - seq.arrival
        self.peak_tokens = max(self.peak_tokens, seq.num_computed_tokens)  # K/V written so far
        return TokenEvent(token_ids, reason, seq.num_prompt_tokens,
                          seq.num_output_tokens, queued_s * 1000, self.compute_s * 1000,
                          self.peak_tokens * self.bytes_per_token, logprobs)


Post = tuple[RequestRecord, TokenEvent | BaseException]


def post_all(posts: Sequence[Post]) -> None:
    """Hand events to their callers' loops with one wake-up per loop, not one per event, so a
    step of 64 sequences wakes the asyncio thread once while the next forward runs."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Post]] = {}
    for record, event in posts:
        by_loop.setdefault(record.loop, []).append((record, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the callers' loop is closed: nobody listens any more
            pass


def _deliver(items: Sequence[Post]) -> None:
    """On the callers' loop: run each caller's ``deliver`` in its own context."""
    for record, event in items:
        try:
            record.context.run(record.deliver, event)
        except Exception:  # noqa: BLE001 - one caller's bug must not starve the others of events
            log.exception("deliver_failed", request_id=record.request.request_id)
