"""A request's cache lookup, run beside its generation (docs/gateway.md, "The cache lookup races
the generation"; docs/decisions.md, decision 52).

The exact tier first: the cache answers it without an embedding, in about a millisecond, and the
pipeline waits for that answer (at most ``cache_exact_wait_ms``) before it starts the generation.
Then, for a chat that missed it, both tiers with the query: the cache embeds the query (tens of
milliseconds) while the generation already runs. A hit that arrives before the generation's
first token replaces the generation, which is cancelled; one that arrives later only keeps the
generated answer out of the cache, which answers that question already. A failed lookup is a
miss: it never fails a request. No grpc, no pb.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TypeVar

from aiserve.common.finish import FinishReason
from aiserve.common.logging import get_logger
from services.gateway.domain import CachedAnswer, CacheKey
from services.gateway.interfaces import AnswerCache, AnswerStore

log = get_logger("cache_lookup")

T = TypeVar("T")

OUTCOMES = ("hit", "hit_cancelled", "late_hit", "miss")
"""How a lookup ended: a hit before any generation started; a hit after the generation started
but before its first token (the generation was cancelled); a hit after the first token (the
generated answer was served, and not stored); a miss (a failed lookup included)."""

_keeping: set[asyncio.Task[str]] = set()
"""Stores waiting for their lookup's answer, held until they end (the client may have left)."""


def no_count(outcome: str) -> None:
    """The default outcome hook: nothing is counted."""


class CacheLookup:
    """One request's lookup: started at once; the pipeline asks it for the exact tier's answer
    (``exact``), races it against the generation's first item (``first_of``) and lets it decide
    whether the generated answer is kept (``keep``)."""

    def __init__(self, cache: AnswerCache, key: CacheKey, min_similarity: float | None,
                 on_outcome: Callable[[str], None] = no_count) -> None:
        self._cache, self._key, self._min_similarity = cache, key, min_similarity
        self._on_outcome = on_outcome
        self._exact_answered = asyncio.Event()
        self._exact: CachedAnswer | None = None
        self._is_generating = False  # the generation started: a hit now cancels it
        self._is_streaming = False  # its first item is on its way to the client: a hit now is too late
        self._is_kept = False  # a store waits for the answer: the lookup must not be cancelled
        self.task: asyncio.Task[CachedAnswer | None] = asyncio.ensure_future(self._run())
        self.task.add_done_callback(self._count)

    async def _run(self) -> CachedAnswer | None:
        self._exact = await self._ask(replace(self._key, query=""))  # no query: no embedding
        self._exact_answered.set()
        if self._exact is not None or not self._key.query:
            return self._exact
        return await self._ask(self._key)

    async def _ask(self, key: CacheKey) -> CachedAnswer | None:
        try:
            return await self._cache.lookup(key, self._min_similarity)
        except Exception as exc:  # the cache is an optimisation: a failed lookup is a miss
            log.warning("cache_lookup_failed", error=f"{type(exc).__name__}: {exc}")
            return None

    def _count(self, task: asyncio.Task[CachedAnswer | None]) -> None:
        if task.cancelled():  # the request ended before the lookup did: no outcome
            return
        if (hit := task.result()) is None:
            outcome = "miss"
        elif self._is_streaming:  # the race was lost: the answer is generated all the same
            outcome = "late_hit"
            log.info("cache_hit_after_first_token", entry_id=hit.entry_id, similarity=hit.similarity)
        else:
            outcome = "hit_cancelled" if self._is_generating else "hit"
        self._on_outcome(outcome)

    def hit(self) -> CachedAnswer | None:
        """The hit, if the lookup has found one by now."""
        return self.task.result() if self.task.done() and not self.task.cancelled() else None

    async def exact(self, wait_s: float) -> CachedAnswer | None:
        """The exact tier's hit if it answers within ``wait_s``; None: a miss, or no answer yet."""
        if wait_s > 0 and not self._exact_answered.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exact_answered.wait(), wait_s)
        return self._exact

    async def first_of(self, items: AsyncIterator[T]) -> T | CachedAnswer:
        """The generation's first item, or the hit if the lookup finds one before that item is
        ready: the generation is then cancelled, and nothing of it was sent. The item is never
        held for the lookup. A generation that fails before its first item waits for the
        lookup: a hit still answers (a miss raises the generation's error)."""
        if (hit := self.hit()) is not None:
            return hit
        self._is_generating = True
        first = asyncio.create_task(_next(items))
        try:
            await asyncio.wait((first, self.task), return_when=asyncio.FIRST_COMPLETED)
            if _failed(first) and not self.task.done():
                await asyncio.wait((self.task,))
        except BaseException:
            await _cancel(first)
            raise
        if (hit := self.hit()) is None:
            self._is_streaming = True
            return await first
        await _cancel(first)
        return hit

    def keep(self, store: AnswerStore, finish_reason: FinishReason) -> asyncio.Task[str]:
        """Commit ``store`` once the lookup has answered, unless it found an answer (a late hit:
        the cache answers this question already). A task of its own, held until it ends: a
        client that leaves meanwhile does not cancel it. Returns the entry id ("" = not kept)."""
        self._is_kept = True
        task = asyncio.ensure_future(self._commit_unless_hit(store, finish_reason))
        _keeping.add(task)
        task.add_done_callback(_keeping.discard)
        return task

    async def _commit_unless_hit(self, store: AnswerStore, finish_reason: FinishReason) -> str:
        if await self.task is None:
            return await store.commit(finish_reason)
        store.abort()
        return ""

    def close(self) -> None:
        """The request ended: stop the lookup, unless a store waits for its answer."""
        if not self._is_kept:
            self.task.cancel()


async def _next(items: AsyncIterator[T]) -> T:
    return await anext(items)


async def _cancel(task: asyncio.Task[T]) -> None:
    """Cancel ``task`` and wait until it has ended (the generation it drives is then closed)."""
    task.cancel()
    await asyncio.wait((task,))
    _failed(task)  # an error of a generation that lost the race is not the request's


def _failed(task: asyncio.Task[T]) -> bool:
    """Whether ``task`` ended with an error (which counts as retrieved)."""
    return task.done() and not task.cancelled() and task.exception() is not None
