"""One generation, end to end: route -> render -> fit the context -> cache -> generate ->
detokenize -> stop strings -> usage -> cache store (DESIGN.md §2).

This is the gateway's orchestration; it speaks pb only to the backends it calls, and hands
domain values (Chunk, Final) to the servicer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from aiserve.common.errors import Unavailable
from aiserve.common.finish import STORABLE, FinishReason
from aiserve.common.logging import get_logger
from aiserve.common.pb_enums import finish_reason_from_pb, finish_reason_to_pb
from aiserve.v1 import cache_pb2, common_pb2, inference_pb2, tokenizer_pb2
from services.gateway.backends import Backends, RouteInfo, downstream_error
from services.gateway.cache_client import CacheKey, StoreStream, cache_key, replay
from services.gateway.cache_client import lookup as cache_lookup
from services.gateway.config import GatewayConfig
from services.gateway.detok_mux import DetokenizeMux
from services.gateway.generate_mux import CallPerGeneration, GenerateMux, Generations
from services.gateway.pricing import PriceTable
from services.gateway.stops import StopMatcher
from services.gateway.validation import Sampling, fit_prompt

log = get_logger("pipeline")

_TRUNCATED = "[truncated-left:"  # prefix of a prompt cut to fit: a distinct cache key, never matched by meaning


@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """A validated request, as the pipeline needs it."""

    request_id: str
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    sampling: Sampling
    model: str = ""
    cache_policy: str = "use"  # "use" | "bypass" | "refresh"
    personalized: bool = False
    truncate_left: bool = False
    tenant: str = ""
    priority: int = 0
    """Scheduling priority of the tenant's tier; higher is admitted to the batch first."""
    cache_min_similarity: float | None = None
    """A stricter similarity threshold for a cache hit by meaning (None = the cache's default)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """Text that became available, and the ids behind it."""

    text_delta: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class UsageRecord:
    prompt_tokens: int
    completion_tokens: int
    cache_hit: bool
    queue_ms: int
    ttft_ms: int
    total_ms: int
    model: str
    cost_micros: int
    cache_similarity: float = 0.0
    compute_ms: int = 0
    kv_peak_bytes: int = 0
    cache_entry_id: str = ""
    """On a cache hit: the entry that answered (feedback on the answer is reported to it)."""


@dataclass(frozen=True, slots=True)
class Final:
    finish_reason: FinishReason
    usage: UsageRecord


@dataclass(slots=True)
class _Prompt:
    text: str
    token_ids: list[int]


class Pipeline:
    """Runs requests against the backends."""

    def __init__(self, config: GatewayConfig, backends: Backends, prices: PriceTable) -> None:
        self.config = config
        self.backends = backends
        self.prices = prices  # the one table accounting reserves with, so cost and reservation agree
        self.detokenizer = DetokenizeMux(backends.tokenizer)  # one call shared by all generations
        self.generations: Generations = (  # likewise, unless a balancer needs a call each (decision 34)
            GenerateMux(backends.inference) if config.generate_mux else CallPerGeneration(backends.inference))

    async def generate(
        self, req: GatewayRequest, timeout_s: float | None, admit: Callable[[int, str], None] | None = None
    ) -> AsyncGenerator[Chunk | Final, None]:
        """Yield Chunks then one Final; after the Final, store the answer in the cache.

        ``timeout_s`` is the client's remaining deadline (None = the default): every downstream
        call gets what is left of it. ``admit(prompt_tokens, model)`` runs once the prompt is
        tokenized and fitted, before the cache and the model; it raises to refuse the request.
        """
        started = time.perf_counter()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.downstream_timeout_s)
        route = await self.backends.route(req.model)
        prompt = await self._render(req)
        self._fit_context(req, prompt, route)
        if admit is not None:
            admit(len(prompt.token_ids), route.model)
        key = cache_key(route.model, req.tenant, req.sampling.cache_key(), prompt.text, req.messages,
                        is_truncated=prompt.text.startswith(_TRUNCATED))
        use_cache = self._cacheable(req)
        if use_cache and req.cache_policy == "use":
            hit = await self._lookup(key, req.cache_min_similarity)
            if hit is not None:
                for text, ids in replay(hit):  # as it was streamed, delta by delta
                    yield Chunk(text, ids)
                ms = _ms_since(started)
                usage = self._usage(len(prompt.token_ids), len(hit.token_ids), route.model, 0, ms, ms,
                                    cache_hit=True, similarity=hit.similarity, entry_id=hit.entry_id)
                yield Final(finish_reason_from_pb(hit.finish_reason) or FinishReason.STOP, usage)
                return
        store = self._store(key, deadline) if use_cache else None  # streams into the cache as it goes
        try:
            text_parts: list[str] = []
            token_ids: list[int] = []
            ttft_ms = 0
            final_pb: inference_pb2.InferenceResponse | None = None
            async for delta, ids, last in self._stream(req, route.model, prompt, deadline):
                token_ids.extend(ids)
                if delta:
                    ttft_ms = ttft_ms or _ms_since(started)
                    text_parts.append(delta)
                if delta or ids:
                    if store is not None:
                        store.add(delta, ids)
                    yield Chunk(delta, ids)
                final_pb = last or final_pb
            # No finish reason on the last message read: a stop string ended it (we cancelled).
            finish = (finish_reason_from_pb(final_pb.finish_reason) if final_pb else None) or FinishReason.STOP
            usage = self._usage(
                len(prompt.token_ids), len(token_ids), route.model,
                final_pb.queue_ms if final_pb else 0, ttft_ms or _ms_since(started), _ms_since(started),
                compute_ms=final_pb.compute_ms if final_pb else 0,
                kv_peak_bytes=final_pb.kv_peak_bytes if final_pb else 0,
            )
            yield Final(finish, usage)
            if store is not None and finish in STORABLE:
                await store.commit(finish_reason_to_pb(finish))  # only a normally finished answer is kept
        finally:
            if store is not None:
                store.abort()  # a cancelled or failed generation leaves nothing behind (no-op after commit)

    async def count_tokens(self, request: common_pb2.CountTokensRequest) -> common_pb2.CountTokensResponse:
        route = await self.backends.route(request.model)
        forwarded = common_pb2.CountTokensRequest()
        forwarded.CopyFrom(request)
        forwarded.model = route.model
        try:
            reply = await self.backends.tokenizer.CountTokens(forwarded, timeout=30)
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc
        reply.context_length = route.context_length
        return reply

    async def _render(self, req: GatewayRequest) -> _Prompt:
        try:
            if req.messages is not None:
                messages = [common_pb2.Message(role=r, content=c) for r, c in req.messages]
                rendered = await self.backends.tokenizer.ApplyChatTemplate(
                    tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, add_generation_prompt=True),
                    timeout=30,
                )
                return _Prompt(rendered.text, list(rendered.token_ids))
            assert req.prompt is not None
            tokens = await self.backends.tokenizer.Tokenize(
                tokenizer_pb2.TokenizeRequest(text=req.prompt, add_special_tokens=True), timeout=30
            )
            return _Prompt(req.prompt, list(tokens.token_ids))
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc

    def _fit_context(self, req: GatewayRequest, prompt: _Prompt, route: RouteInfo) -> None:
        """Source §2.2: the context is a hard limit. Refuse, or drop the oldest tokens if asked."""
        fitted = fit_prompt(prompt.token_ids, req.sampling.max_new_tokens, route.context_length, route.model,
                            self.config.max_prompt_tokens, req.truncate_left)
        if len(fitted) < len(prompt.token_ids):
            prompt.token_ids = fitted
            prompt.text = f"{_TRUNCATED}{len(fitted)}]" + prompt.text  # distinct cache key

    def _cacheable(self, req: GatewayRequest) -> bool:
        sampling = req.sampling
        return (
            self.backends.cache is not None
            and req.cache_policy != "bypass"
            and not req.personalized
            and sampling.temperature <= self.config.cache_max_temperature
        )

    async def _stream(
        self, req: GatewayRequest, model: str, prompt: _Prompt, deadline: float
    ) -> AsyncIterator[tuple[str, tuple[int, ...], inference_pb2.InferenceResponse | None]]:
        """(text delta, ids, last message or None) as tokens arrive; cancels what it started."""
        s = req.sampling
        decoding = inference_pb2.Decoding(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            repetition_penalty=s.repetition_penalty, max_new_tokens=s.max_new_tokens,
        )
        if s.seed is not None:
            decoding.seed = s.seed
        request = inference_pb2.InferenceRequest(
            request_id=req.request_id, model=model, prompt_token_ids=prompt.token_ids,
            decoding=decoding, priority=req.priority,
        )
        # the client's deadline becomes the generation's deadline
        generation = self.generations.open(request, _remaining_s(deadline))
        detok = self.detokenizer.open(req.request_id, skip_special_tokens=True)
        stops = StopMatcher(s.stop)
        try:
            while True:
                message = await generation.read(_remaining_s(deadline))
                ids = tuple(message.token_ids)
                delta = await detok.push(ids, _remaining_s(deadline)) if ids else ""
                text = stops.feed(delta)
                last = message  # every message carries the running counters (queue, compute, KV)
                yield text, ids, last
                if stops.stopped:
                    return
                if message.finish_reason:
                    break
            text = stops.feed(await detok.finish(_remaining_s(deadline))) + stops.flush()
            if text:
                yield text, (), None
        except Unavailable:  # inference or the tokenizer's shared call broke, or inference is stopping
            self.backends.forget_route()
            raise
        finally:
            generation.close()
            detok.close()

    async def _lookup(self, key: CacheKey, min_similarity: float | None) -> cache_pb2.LookupResponse | None:
        assert self.backends.cache is not None
        return await cache_lookup(self.backends.cache, key, min_similarity)

    def _store(self, key: CacheKey, deadline: float) -> StoreStream:
        assert self.backends.cache is not None
        return StoreStream(self.backends.cache, key, timeout_s=_remaining_s(deadline) + 5.0)

    def _usage(self, prompt_tokens: int, completion_tokens: int, model: str, queue_ms: int,
               ttft_ms: int, total_ms: int, cache_hit: bool = False, similarity: float = 0.0,
               compute_ms: int = 0, kv_peak_bytes: int = 0, entry_id: str = "") -> UsageRecord:
        # A cache hit costs only the lookup: no tokens are computed, so none are billed.
        cost = 0 if cache_hit else self.prices.cost(model, prompt_tokens, completion_tokens, compute_ms)
        return UsageRecord(prompt_tokens, completion_tokens, cache_hit, queue_ms, ttft_ms, total_ms,
                           model, cost, similarity, compute_ms, kv_peak_bytes, entry_id)


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)


def _remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline`` (monotonic), at least a millisecond (gRPC needs > 0)."""
    return max(deadline - time.monotonic(), 0.001)
