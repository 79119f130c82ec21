"""pb <-> domain for the gateway's public API (``aiserve.v1.Gateway``): the servicer's only
conversions. Requests are validated on the way in (INVALID_ARGUMENT names the field and limit).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiserve.common.pb_enums import finish_reason_to_pb
from aiserve.v1 import common_pb2, gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.domain import (
    ChatMessages,
    Chunk,
    Final,
    GatewayRequest,
    TokenCount,
    TokenCountRequest,
    TokenLogprob,
    UsageRecord,
)
from services.gateway.ledger import Bucket, Totals
from services.gateway.validation import (
    SamplingInput,
    checked_logprobs,
    checked_min_similarity,
    checked_response_format,
    resolve_sampling,
    validate_input,
)

_CACHE_POLICY = {
    gateway_pb2.CACHE_POLICY_USE: "use",
    gateway_pb2.CACHE_POLICY_BYPASS: "bypass",
    gateway_pb2.CACHE_POLICY_REFRESH: "refresh",
}


def _input_from_pb(request: gateway_pb2.GenerateRequest | common_pb2.CountTokensRequest,
                   config: GatewayConfig) -> tuple[str | None, ChatMessages | None]:
    """The request's prompt or chat (exactly one), validated."""
    kind = request.WhichOneof("input")
    prompt = request.prompt if kind == "prompt" else None
    messages = tuple((m.role, m.content) for m in request.chat.messages) if kind == "chat" else None
    validate_input(prompt, messages, config)
    return prompt, messages


def _sampling_from_pb(sp: common_pb2.SamplingParams) -> SamplingInput:
    """What the client set (proto3 optional fields: unset = None)."""
    return SamplingInput(
        temperature=sp.temperature if sp.HasField("temperature") else None,
        top_p=sp.top_p if sp.HasField("top_p") else None,
        top_k=sp.top_k if sp.HasField("top_k") else None,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
        max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
        stop=tuple(sp.stop),
        seed=sp.seed if sp.HasField("seed") else None,
        preset=sp.preset,
    )


def request_from_pb(request: gateway_pb2.GenerateRequest, config: GatewayConfig, request_id: str) -> GatewayRequest:
    """Validate and convert a GenerateRequest."""
    prompt, messages = _input_from_pb(request, config)
    return GatewayRequest(
        request_id=request_id,
        prompt=prompt,
        messages=messages,
        sampling=resolve_sampling(_sampling_from_pb(request.sampling), config),
        model=request.model,
        cache_policy=_CACHE_POLICY.get(request.cache, "use"),
        personalized=request.personalized,
        truncate_left=request.truncation == gateway_pb2.TRUNCATION_LEFT,
        cache_min_similarity=checked_min_similarity(
            request.cache_min_similarity if request.HasField("cache_min_similarity") else None),
        logprobs=checked_logprobs(request.logprobs.enabled, request.logprobs.top_logprobs),
        response_format=checked_response_format(request.response_format.WhichOneof("format"),
                                                request.response_format.json_schema.schema),
    )


def count_request_from_pb(request: common_pb2.CountTokensRequest, config: GatewayConfig) -> TokenCountRequest:
    """Validate and convert a CountTokensRequest."""
    prompt, messages = _input_from_pb(request, config)
    return TokenCountRequest(prompt, messages, request.model)


def count_to_pb(count: TokenCount, request_id: str) -> common_pb2.CountTokensResponse:
    return common_pb2.CountTokensResponse(token_count=count.token_count, context_length=count.context_length,
                                          model=count.model, request_id=request_id)


def usage_to_pb(usage: UsageRecord) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cache_hit=usage.cache_hit, queue_ms=usage.queue_ms, ttft_ms=usage.ttft_ms,
        total_ms=usage.total_ms, model=usage.model, cost_micros=usage.cost_micros,
        cache_similarity=usage.cache_similarity,
    )


def chunk_to_pb(chunk: Chunk, request_id: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(request_id=request_id, text_delta=chunk.text_delta, token_ids=chunk.token_ids,
                                        logprobs=[logprob_to_pb(lp) for lp in chunk.logprobs])


def _token_text(token_bytes: bytes) -> str:
    """A token's text: its bytes as UTF-8, a broken character replaced (OpenAI's "token")."""
    return token_bytes.decode("utf-8", errors="replace")


def logprob_to_pb(lp: TokenLogprob) -> gateway_pb2.TokenLogprob:
    """domain -> pb: the token and its alternatives, each with text and bytes."""
    return gateway_pb2.TokenLogprob(
        token_id=lp.token_id, token=_token_text(lp.token_bytes), token_bytes=lp.token_bytes, logprob=lp.logprob,
        top=[gateway_pb2.TopLogprob(token_id=a.token_id, token=_token_text(a.token_bytes), token_bytes=a.token_bytes,
                                    logprob=a.logprob) for a in lp.top])


def final_to_pb(final: Final, request_id: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(request_id=request_id, finish_reason=finish_reason_to_pb(final.finish_reason),
                                        usage=usage_to_pb(final.usage))


def complete_to_pb(chunks: Sequence[Chunk], final: Final | None, request_id: str) -> gateway_pb2.CompleteResponse:
    """A whole generation as one CompleteResponse (the text and ids of every chunk, in order)."""
    reply = gateway_pb2.CompleteResponse(
        request_id=request_id, text="".join(c.text_delta for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        logprobs=[logprob_to_pb(lp) for c in chunks for lp in c.logprobs],
    )
    if final is not None:
        reply.finish_reason = finish_reason_to_pb(final.finish_reason)
        reply.usage.CopyFrom(usage_to_pb(final.usage))
    return reply


def totals_to_pb(totals: Totals) -> gateway_pb2.UsageTotals:
    return gateway_pb2.UsageTotals(requests=totals.requests, prompt_tokens=totals.prompt_tokens,
                                   completion_tokens=totals.completion_tokens, cost_micros=totals.cost_micros)


def usage_response_to_pb(tenant: str, total: Totals, buckets: Sequence[Bucket],
                         request_id: str) -> gateway_pb2.UsageResponse:
    return gateway_pb2.UsageResponse(
        total=totals_to_pb(total), tenant=tenant, request_id=request_id,
        buckets=[gateway_pb2.UsageBucket(day=b.day, model=b.model, totals=totals_to_pb(b.totals)) for b in buckets],
    )
