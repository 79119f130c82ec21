"""One generation, end to end: route -> render -> fit the context -> admit -> the cache's exact
tier -> generate while the lookup by meaning runs -> detokenize -> stop strings -> usage -> cache
store (docs/gateway.md).

The gateway's core. It speaks domain values only: to its backends through the interfaces of
``services/gateway/interfaces.py``, to the servicer with Chunks and one Final. No grpc, no pb.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing

from aiserve.common.errors import ApiError, ErrorKind, Unavailable
from aiserve.common.finish import STORABLE, FinishReason
from aiserve.common.logging import get_logger
from services.gateway.cache_keys import cache_key
from services.gateway.cache_lookup import CacheLookup, no_count
from services.gateway.config import GatewayConfig
from services.gateway.domain import (
    CachedAnswer,
    CacheKey,
    Chunk,
    Final,
    GatewayRequest,
    GenerationEvent,
    GenerationRequest,
    RenderedPrompt,
    RequestOutcome,
    RouteInfo,
    TokenAlternative,
    TokenCount,
    TokenCountRequest,
    TokenLogprob,
    UsageRecord,
)
from services.gateway.interfaces import AnswerCache, AnswerStore, NoObserver, PipelineBackends, RequestObserver
from services.gateway.pricing import PriceTable
from services.gateway.stops import StopMatcher
from services.gateway.validation import fit_prompt

log = get_logger("pipeline")

_TRUNCATED = "[truncated-left:"  # prefix of a prompt cut to fit: a distinct cache key, never matched by meaning
STORE_GRACE_S = 5.0
"""A cache store may outlive the client's deadline by this much: it commits after the last message."""

Admit = Callable[[int, str], None]
"""``admit(prompt_tokens, model)``: raises to refuse a request once its prompt is tokenized."""
OpenStore = Callable[[], AnswerStore]

_VERSION_ERRORS = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.INTERNAL, ErrorKind.DEADLINE_EXCEEDED,
                             ErrorKind.FAILED_PRECONDITION, ErrorKind.UNKNOWN})
"""Errors that count against the version that answered (the others are the client's own)."""


class Pipeline:
    """Runs requests against the backends."""

    def __init__(self, config: GatewayConfig, backends: PipelineBackends, prices: PriceTable,
                 observer: RequestObserver | None = None, on_cache_lookup: Callable[[str], None] = no_count) -> None:
        self.config = config
        self.backends = backends
        self.prices = prices  # the one table accounting reserves with, so cost and reservation agree
        self.observer: RequestObserver = observer if observer is not None else NoObserver()
        self.on_cache_lookup = on_cache_lookup
        """Told how each cache lookup ended (services/gateway/cache_lookup.py, OUTCOMES)."""

    async def generate(self, req: GatewayRequest, timeout_s: float | None,
                       admit: Admit | None = None) -> AsyncGenerator[Chunk | Final, None]:
        """Yield Chunks then one Final; after the Final, store the answer in the cache.

        ``timeout_s`` is the client's remaining deadline (None = the default): every downstream
        call gets what is left of it. ``admit`` runs once the prompt is tokenized and fitted,
        before the cache and the model.
        """
        started = time.perf_counter()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.downstream_timeout_s)
        version = self.backends.router.pick(req.model, req.tenant, req.session)
        try:  # the whole request runs on the version it was routed to
            route = await self.backends.router.route(version)
            async with aclosing(self._generate_on(route, req, started, deadline, admit)) as items:
                async for item in items:
                    if isinstance(item, Final):
                        self.observer.observe(_outcome(item))
                    yield item
        except Exception as exc:
            if not isinstance(exc, ApiError) or exc.kind in _VERSION_ERRORS:
                self.observer.observe(RequestOutcome(version, 0, 0.0, True, False, 0))
            raise
        finally:
            self.backends.router.release(version)

    async def _generate_on(self, route: RouteInfo, req: GatewayRequest, started: float, deadline: float,
                           admit: Admit | None) -> AsyncGenerator[Chunk | Final, None]:
        prompt = self._fit_context(req, await self._render(req, route.model), route)
        if admit is not None:
            admit(len(prompt.token_ids), route.model)
        key = cache_key(route.model, req.tenant, _params_key(req), prompt.text, req.messages,
                        is_truncated=prompt.text.startswith(_TRUNCATED))
        cache = self.backends.cache if self._cacheable(req) else None
        lookup = None
        if cache is not None and req.cache_policy == "use":
            lookup = CacheLookup(cache, key, req.cache_min_similarity, self.on_cache_lookup)
        try:
            # The exact tier answers in about a millisecond: worth waiting for before any model work.
            hit = await lookup.exact(self.config.cache_exact_wait_ms / 1000) if lookup is not None else None
            if hit is not None:
                for item in _replay(hit, len(prompt.token_ids), route.model, started):
                    yield item
                return
            open_store = None if cache is None else _store_opener(cache, key, deadline)
            async with aclosing(self._answer(req, route.model, prompt, started, deadline, lookup, open_store)) as items:
                async for item in items:
                    yield item
        finally:
            if lookup is not None:
                lookup.close()  # no-op once it ended or a store waits for it

    async def _answer(self, req: GatewayRequest, model: str, prompt: RenderedPrompt, started: float, deadline: float,
                      lookup: CacheLookup | None, open_store: OpenStore | None) -> AsyncGenerator[Chunk | Final, None]:
        """The generation as it streams (into a new store too), its Final, then the store's commit;
        or the cache's answer, when the lookup hits before the generation's first item (the
        generation is cancelled then: nothing of it was sent, and it is not billed)."""
        async with aclosing(self._generated(req, model, prompt, started, deadline)) as items:
            first = await lookup.first_of(items) if lookup is not None else await anext(items)
            if isinstance(first, CachedAnswer):
                log.info("generation_cancelled_for_cache_hit", similarity=first.similarity, entry_id=first.entry_id)
                for item in _replay(first, len(prompt.token_ids), model, started):
                    yield item
                return
            store = open_store() if open_store is not None else None
            try:
                async for item in _prepend(first, items):
                    if isinstance(item, Chunk) and store is not None:
                        store.add(item)
                    yield item
                    if isinstance(item, Final) and store is not None and item.finish_reason in STORABLE:
                        kept, store = store, None  # only a normally finished answer is kept, after its Final
                        if lookup is None:
                            await kept.commit(item.finish_reason)
                        else:  # unless the lookup found an answer meanwhile
                            await asyncio.shield(lookup.keep(kept, item.finish_reason))
            finally:
                if store is not None:
                    store.abort()  # a cancelled or failed generation leaves nothing behind

    async def count_tokens(self, request: TokenCountRequest) -> TokenCount:
        """Tokens of the request's input as a generation would render it, on the checked route."""
        version = self.backends.router.pick(request.model)
        try:
            route = await self.backends.router.route(version)
            count = await self.backends.tokenizer.count_tokens(request.prompt, request.messages, route.model)
        finally:
            self.backends.router.release(version)
        return TokenCount(count, route.context_length, route.model)

    async def report_cache_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        """Tell the cache how an answer it served was rated (it may evict the entry)."""
        if self.backends.cache is not None and entry_id:
            await self.backends.cache.report_feedback(entry_id, is_negative, similarity)

    async def _render(self, req: GatewayRequest, model: str) -> RenderedPrompt:
        if req.messages is not None:
            return await self.backends.tokenizer.apply_chat_template(req.messages, model)
        assert req.prompt is not None
        return RenderedPrompt(req.prompt, await self.backends.tokenizer.tokenize(req.prompt, model))

    def _fit_context(self, req: GatewayRequest, prompt: RenderedPrompt, route: RouteInfo) -> RenderedPrompt:
        """The context is a hard limit: refuse, or drop the oldest tokens if asked."""
        fitted = fit_prompt(prompt.token_ids, req.sampling.max_new_tokens, route.context_length, route.model,
                            self.config.max_prompt_tokens, req.truncate_left)
        if len(fitted) == len(prompt.token_ids):
            return prompt
        return RenderedPrompt(f"{_TRUNCATED}{len(fitted)}]" + prompt.text, tuple(fitted))  # distinct cache key

    def _cacheable(self, req: GatewayRequest) -> bool:
        return (
            self.backends.cache is not None
            and req.cache_policy != "bypass"
            and not req.personalized
            and req.sampling.temperature <= self.config.cache_max_temperature
            and req.logprobs is None  # a cached answer has no log-probabilities to replay
        )

    async def _generated(self, req: GatewayRequest, model: str, prompt: RenderedPrompt, started: float,
                         deadline: float) -> AsyncGenerator[Chunk | Final, None]:
        """The generation as it streams, then its Final."""
        num_tokens, ttft_ms = 0, 0
        last: GenerationEvent | None = None
        async with aclosing(self._stream(req, model, prompt, deadline)) as chunks:
            async for chunk, event in chunks:
                num_tokens += len(chunk.token_ids)
                if chunk.text_delta:
                    ttft_ms = ttft_ms or _ms_since(started)
                if chunk.text_delta or chunk.token_ids:
                    yield chunk
                last = event or last
        # No finish reason on the last event read: a stop string ended it (we cancelled).
        finish = (last.finish_reason if last is not None else None) or FinishReason.STOP
        yield Final(finish, self._usage(len(prompt.token_ids), num_tokens, model, last, ttft_ms, _ms_since(started)))

    async def _stream(self, req: GatewayRequest, model: str, prompt: RenderedPrompt,
                      deadline: float) -> AsyncGenerator[tuple[Chunk, GenerationEvent | None], None]:
        """(chunk, the event it came from) as tokens arrive, cut at a stop string, then the
        held-back text (with no event); cancels what it started unless it ended."""
        request = GenerationRequest(req.request_id, model, prompt.token_ids, req.sampling, req.priority,
                                    req.logprobs, req.response_format)
        generation = self.backends.generations.open(request, _remaining_s(deadline))  # the client's deadline
        detok = self.backends.detokenizer.open(req.request_id, skip_special_tokens=True, model=model)
        stops = StopMatcher(req.sampling.stop)
        try:
            while True:
                event = await generation.read(_remaining_s(deadline))
                delta = await detok.push(event.token_ids, _remaining_s(deadline)) if event.token_ids else ""
                logprobs = await self._logprobs(event, model, deadline) if event.logprobs else ()
                yield Chunk(stops.feed(delta), event.token_ids, logprobs), event  # events carry the running counters
                if stops.stopped:
                    return
                if event.finish_reason is not None:
                    break
            rest = stops.feed(await detok.finish(_remaining_s(deadline))) + stops.flush()
            if rest:
                yield Chunk(rest, ()), None
        except Unavailable:  # inference or the tokenizer's shared call broke, or inference is stopping
            self.backends.router.forget_route()
            raise
        finally:
            generation.close()
            detok.close()

    async def _logprobs(self, event: GenerationEvent, model: str, deadline: float) -> tuple[TokenLogprob, ...]:
        """The event's log-probabilities with each token's bytes (one tokenizer call per event)."""
        ids = [*event.token_ids, *(i for lp in event.logprobs for i, _ in lp.top)]
        pieces = dict(zip(ids, await asyncio.wait_for(self.backends.tokenizer.token_bytes(ids, model),
                                                      _remaining_s(deadline)), strict=True))
        return tuple(TokenLogprob(token, pieces[token], lp.logprob,
                                  tuple(TokenAlternative(i, pieces[i], v) for i, v in lp.top))
                     for token, lp in zip(event.token_ids, event.logprobs, strict=True))

    def _usage(self, prompt_tokens: int, completion_tokens: int, model: str, last: GenerationEvent | None,
               ttft_ms: int, total_ms: int) -> UsageRecord:
        """A generated answer's usage; its cost from the price table."""
        compute_ms = last.compute_ms if last is not None else 0
        return UsageRecord(
            prompt_tokens, completion_tokens, cache_hit=False, queue_ms=last.queue_ms if last is not None else 0,
            ttft_ms=ttft_ms or total_ms, total_ms=total_ms, model=model,
            cost_micros=self.prices.cost(model, prompt_tokens, completion_tokens, compute_ms),
            compute_ms=compute_ms, kv_peak_bytes=last.kv_peak_bytes if last is not None else 0,
        )


def _replay(hit: CachedAnswer, prompt_tokens: int, model: str, started: float) -> Iterator[Chunk | Final]:
    """A cache hit in one message, then its Final: the answer is whole already, and sending it
    delta by delta as it was generated cost the client ~0.1 ms a message (5-7 ms for 64 tokens,
    more the longer the answer). It costs only the lookup: no tokens are computed, so none are
    billed."""
    if hit.deltas:
        yield Chunk("".join(d.text_delta for d in hit.deltas), tuple(t for d in hit.deltas for t in d.token_ids))
    ms = _ms_since(started)
    yield Final(hit.finish_reason, UsageRecord(
        prompt_tokens, hit.completion_tokens, cache_hit=True, queue_ms=0, ttft_ms=ms, total_ms=ms, model=model,
        cost_micros=0, cache_similarity=hit.similarity, cache_entry_id=hit.entry_id))


def _store_opener(cache: AnswerCache, key: CacheKey, deadline: float) -> OpenStore:
    """Opens a store for ``key`` when the generation's first item is sent (never before: a hit may cancel it)."""
    return lambda: cache.open_store(key, _remaining_s(deadline) + STORE_GRACE_S)


async def _prepend(first: Chunk | Final, rest: AsyncIterator[Chunk | Final]) -> AsyncIterator[Chunk | Final]:
    yield first
    async for item in rest:
        yield item


def _outcome(final: Final) -> RequestOutcome:
    """A finished request as the observer sees it."""
    u = final.usage
    tpot_ms = (u.total_ms - u.ttft_ms) / (u.completion_tokens - 1) if u.completion_tokens > 1 else 0.0
    return RequestOutcome(u.model, u.ttft_ms, tpot_ms, False, u.cache_hit, u.cost_micros)


def _params_key(req: GatewayRequest) -> str:
    """The decoding parameters and the response format: both change the answer, so both scope it."""
    params = req.sampling.cache_key()
    return params if req.response_format is None else params + req.response_format.cache_key()


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)


def _remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), at least a millisecond (a backend needs > 0)."""
    return max(deadline - time.monotonic(), 0.001)
