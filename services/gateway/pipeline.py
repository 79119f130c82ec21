"""One generation, end to end: route -> render -> fit the context -> cache -> generate ->
detokenize -> stop strings -> usage -> cache store (DESIGN.md §2).

This is the gateway's orchestration; it speaks pb only to the backends it calls, and hands
domain values (Chunk, Final) to the servicer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc import aio

from aiserve.common.errors import InvalidArgument
from aiserve.common.logging import get_logger
from aiserve.v1 import cache_pb2, common_pb2, inference_pb2, tokenizer_pb2
from services.gateway.backends import Backends, RouteInfo, downstream_error
from services.gateway.config import GatewayConfig
from services.gateway.stops import StopMatcher
from services.gateway.validation import Sampling

log = get_logger("pipeline")

_FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}
FINISH_TO_PB = {v: k for k, v in _FINISH_FROM_PB.items()}


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


@dataclass(frozen=True, slots=True)
class Final:
    finish_reason: str
    usage: UsageRecord


@dataclass(slots=True)
class _Prompt:
    text: str
    token_ids: list[int]


class Pipeline:
    """Runs requests against the backends."""

    def __init__(self, config: GatewayConfig, backends: Backends) -> None:
        self.config = config
        self.backends = backends

    async def generate(self, req: GatewayRequest, timeout_s: float | None) -> AsyncIterator[Chunk | Final]:
        """Yield Chunks then one Final; after the Final, store the answer in the cache."""
        started = time.perf_counter()
        route = await self.backends.route(req.model)
        prompt = await self._render(req)
        self._fit_context(req, prompt, route)
        scope = cache_pb2.CacheScope(model=route.model, tenant=req.tenant, params=req.sampling.cache_key())
        use_cache = self._cacheable(req)
        if use_cache and req.cache_policy == "use":
            hit = await self._lookup(scope, prompt.text)
            if hit is not None:
                yield Chunk(hit.text, tuple(hit.token_ids))
                ms = _ms_since(started)
                usage = self._usage(len(prompt.token_ids), len(hit.token_ids), route.model, 0, ms, ms,
                                    cache_hit=True, similarity=hit.similarity)
                yield Final(_FINISH_FROM_PB.get(hit.finish_reason, "stop"), usage)
                return
        text_parts: list[str] = []
        token_ids: list[int] = []
        ttft_ms = 0
        final_pb: inference_pb2.InferenceResponse | None = None
        async for delta, ids, last in self._stream(req, route.model, prompt, timeout_s):
            token_ids.extend(ids)
            if delta:
                ttft_ms = ttft_ms or _ms_since(started)
                text_parts.append(delta)
            if delta or ids:
                yield Chunk(delta, ids)
            final_pb = last or final_pb
        finish = _FINISH_FROM_PB.get(final_pb.finish_reason, "stop") if final_pb else "stop"
        if final_pb is None and token_ids:
            finish = "stop"  # ended by a stop string: we cancelled the generation ourselves
        usage = self._usage(
            len(prompt.token_ids), len(token_ids), route.model,
            final_pb.queue_ms if final_pb else 0, ttft_ms or _ms_since(started), _ms_since(started),
        )
        yield Final(finish, usage)
        if use_cache and finish in {"stop", "length"}:
            await self._store(scope, prompt.text, "".join(text_parts), token_ids, finish)

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
        budget = route.context_length - req.sampling.max_new_tokens
        if budget < 1:
            raise InvalidArgument(
                f"sampling.max_new_tokens: must leave room for the prompt in the context of "
                f"{route.context_length} tokens, got {req.sampling.max_new_tokens}"
            )
        if len(prompt.token_ids) <= budget:
            return
        if not req.truncate_left:
            raise InvalidArgument(
                f"prompt: {len(prompt.token_ids)} tokens + max_new_tokens "
                f"{req.sampling.max_new_tokens} exceed the context length {route.context_length} "
                f"of {route.model}; shorten it or set truncation=TRUNCATION_LEFT"
            )
        prompt.token_ids = prompt.token_ids[-budget:]
        prompt.text = f"[truncated-left:{budget}]" + prompt.text  # distinct cache key

    def _cacheable(self, req: GatewayRequest) -> bool:
        sampling = req.sampling
        return (
            self.backends.cache is not None
            and req.cache_policy != "bypass"
            and not req.personalized
            and (sampling.temperature <= self.config.cache_max_temperature or sampling.seed is not None)
        )

    async def _stream(
        self, req: GatewayRequest, model: str, prompt: _Prompt, timeout_s: float | None
    ) -> AsyncIterator[tuple[str, tuple[int, ...], inference_pb2.InferenceResponse | None]]:
        """(text delta, ids, last message or None) as tokens arrive; cancels what it started."""
        s = req.sampling
        decoding = inference_pb2.Decoding(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            repetition_penalty=s.repetition_penalty, max_new_tokens=s.max_new_tokens,
        )
        if s.seed is not None:
            decoding.seed = s.seed
        call = self.backends.inference.Generate(
            inference_pb2.InferenceRequest(
                request_id=req.request_id, model=model, prompt_token_ids=prompt.token_ids,
                decoding=decoding,
            ),
            timeout=timeout_s or self.config.downstream_timeout_s,
        )
        detok = self.backends.tokenizer.DetokenizeStream(timeout=timeout_s or self.config.downstream_timeout_s)
        stops = StopMatcher(s.stop)
        service = "inference"
        try:
            first = True
            async for message in call:
                ids = tuple(message.token_ids)
                service = "tokenizer"
                await detok.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids, skip_special_tokens=first))
                first = False
                delta = (await detok.read()).text_delta  # type: ignore[union-attr]
                service = "inference"
                text = stops.feed(delta)
                last = message if message.finish_reason else None
                yield text, ids, last
                if stops.stopped:
                    return
            service = "tokenizer"
            await detok.done_writing()
            tail = await detok.read()
            text = stops.feed(tail.text_delta if tail is not aio.EOF else "") + stops.flush()  # type: ignore[union-attr]
            if text:
                yield text, (), None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                self.backends.forget_route()
            raise downstream_error(service, exc) from exc
        finally:
            call.cancel()
            detok.cancel()

    async def _lookup(self, scope: cache_pb2.CacheScope, prompt: str) -> cache_pb2.LookupResponse | None:
        assert self.backends.cache is not None
        try:
            reply = await self.backends.cache.Lookup(cache_pb2.LookupRequest(scope=scope, prompt=prompt), timeout=5)
        except grpc.RpcError as exc:  # the cache is an optimisation: a failure is a miss
            log.warning("cache_lookup_failed", code=exc.code().name)  # type: ignore[attr-defined]
            return None
        return reply if reply.hit else None

    async def _store(self, scope: cache_pb2.CacheScope, prompt: str, text: str, ids: list[int], finish: str) -> None:
        assert self.backends.cache is not None
        request = cache_pb2.StoreRequest(
            scope=scope, prompt=prompt, text=text, token_ids=ids, finish_reason=FINISH_TO_PB[finish]
        )
        try:
            await self.backends.cache.Store(request, timeout=5)
        except grpc.RpcError as exc:
            log.warning("cache_store_failed", code=exc.code().name)  # type: ignore[attr-defined]

    def _usage(self, prompt_tokens: int, completion_tokens: int, model: str, queue_ms: int,
               ttft_ms: int, total_ms: int, cache_hit: bool = False, similarity: float = 0.0) -> UsageRecord:
        # A cache hit costs only the lookup: no tokens are computed, so none are billed.
        cost = 0 if cache_hit else (
            prompt_tokens * self.config.prompt_price_micros_per_token
            + completion_tokens * self.config.completion_price_micros_per_token
        )
        return UsageRecord(prompt_tokens, completion_tokens, cache_hit, queue_ms, ttft_ms, total_ms,
                           model, cost, similarity)


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)
