"""The public Gateway service: thin RPCs over the pipeline and the accounting (pb <-> domain
here, nowhere else)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from datetime import datetime

from grpc import aio
from prometheus_client import Counter

from aiserve.common.context import current_request_id, traceparent_var
from aiserve.common.errors import InvalidArgument
from aiserve.common.logging import get_logger
from aiserve.common.pb_enums import finish_reason_to_pb
from aiserve.common.server import ServiceHandle, new_server, run_service
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.accounting import Accounting, RequestAccount
from services.gateway.backends import Backends
from services.gateway.cache_client import checked_min_similarity
from services.gateway.config import GatewayConfig
from services.gateway.ledger import Totals
from services.gateway.pipeline import (
    Chunk,
    Final,
    GatewayRequest,
    Pipeline,
    UsageRecord,
)
from services.gateway.validation import SamplingInput, resolve_sampling, validate_input

log = get_logger("gateway")

REQUESTS = Counter("aiserve_gateway_requests_total", "Finished generations", ["finish_reason", "cache_hit"])
TOKENS = Counter("aiserve_gateway_tokens_total", "Tokens billed", ["kind"])
COST = Counter("aiserve_gateway_cost_micros_total", "Cost billed, in millionths of the currency", ["tier"])

_CACHE_POLICY = {
    gateway_pb2.CACHE_POLICY_USE: "use",
    gateway_pb2.CACHE_POLICY_BYPASS: "bypass",
    gateway_pb2.CACHE_POLICY_REFRESH: "refresh",
}


def request_from_pb(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> GatewayRequest:
    """Validate and convert a GenerateRequest (INVALID_ARGUMENT names the field and limit)."""
    kind = request.WhichOneof("input")
    prompt = request.prompt if kind == "prompt" else None
    messages = [(m.role, m.content) for m in request.chat.messages] if kind == "chat" else None
    validate_input(prompt, messages, config)
    sp = request.sampling
    given = SamplingInput(
        temperature=sp.temperature if sp.HasField("temperature") else None,
        top_p=sp.top_p if sp.HasField("top_p") else None,
        top_k=sp.top_k if sp.HasField("top_k") else None,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
        max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
        stop=tuple(sp.stop),
        seed=sp.seed if sp.HasField("seed") else None,
        preset=sp.preset,
    )
    return GatewayRequest(
        request_id=current_request_id(),
        prompt=prompt,
        messages=tuple(messages) if messages is not None else None,
        sampling=resolve_sampling(given, config),
        model=request.model,
        cache_policy=_CACHE_POLICY.get(request.cache, "use"),
        personalized=request.personalized,
        truncate_left=request.truncation == gateway_pb2.TRUNCATION_LEFT,
        cache_min_similarity=checked_min_similarity(
            request.cache_min_similarity if request.HasField("cache_min_similarity") else None),
    )


def usage_to_pb(usage: UsageRecord) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cache_hit=usage.cache_hit, queue_ms=usage.queue_ms, ttft_ms=usage.ttft_ms,
        total_ms=usage.total_ms, model=usage.model, cost_micros=usage.cost_micros,
        cache_similarity=usage.cache_similarity,
    )


def totals_to_pb(totals: Totals) -> gateway_pb2.UsageTotals:
    return gateway_pb2.UsageTotals(requests=totals.requests, prompt_tokens=totals.prompt_tokens,
                                   completion_tokens=totals.completion_tokens, cost_micros=totals.cost_micros)


def rfc3339_ms(field: str, text: str) -> int | None:
    """An RFC 3339 time as Unix milliseconds; "" = None; INVALID_ARGUMENT names the field."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise InvalidArgument(f"{field}: must be an RFC 3339 time with an offset, e.g. 2025-01-31T00:00:00Z, "
                              f"got {text!r}")
    return int(moment.timestamp() * 1000)


def _authorization(context: aio.ServicerContext) -> str:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == "authorization"), "")


def _record(final: Final, tier: str) -> None:
    REQUESTS.labels(final.finish_reason, str(final.usage.cache_hit).lower()).inc()
    TOKENS.labels("prompt").inc(final.usage.prompt_tokens)
    TOKENS.labels("completion").inc(final.usage.completion_tokens)
    COST.labels(tier).inc(final.usage.cost_micros)
    log.info("generation_finished", finish_reason=final.finish_reason,
             prompt_tokens=final.usage.prompt_tokens, completion_tokens=final.usage.completion_tokens,
             cache_hit=final.usage.cache_hit, ttft_ms=final.usage.ttft_ms, total_ms=final.usage.total_ms,
             compute_ms=final.usage.compute_ms, cost_micros=final.usage.cost_micros)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate, Complete, CountTokens, SubmitFeedback and GetUsage (DESIGN.md §3)."""

    def __init__(self, config: GatewayConfig, pipeline: Pipeline, accounting: Accounting) -> None:
        self.config = config
        self.pipeline = pipeline
        self.accounting = accounting

    def _account(self, api: str, context: aio.ServicerContext) -> RequestAccount:
        return self.accounting.account(api, current_request_id(), traceparent_var.get(), context.time_remaining())

    async def _generate(self, account: RequestAccount, request: gateway_pb2.GenerateRequest,
                        context: aio.ServicerContext) -> AsyncGenerator[Chunk | Final, None]:
        """Authenticate, validate, admit, generate; the Final comes after its row is committed."""
        caller = account.authenticate(_authorization(context))
        req = account.admit(request_from_pb(request, self.config))
        async with aclosing(self.pipeline.generate(req, context.time_remaining(), account.reserve)) as items:
            async for item in items:
                if isinstance(item, Chunk):
                    account.streamed(len(item.token_ids))
                else:
                    await account.finish(item)
                    _record(item, caller.plan.name)
                yield item

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with self._account("Generate", context) as account, \
                aclosing(self._generate(account, request, context)) as items:
            async for item in items:
                if isinstance(item, Chunk):
                    yield gateway_pb2.GenerateResponse(
                        request_id=account.request_id, text_delta=item.text_delta, token_ids=item.token_ids
                    )
                else:
                    yield gateway_pb2.GenerateResponse(
                        request_id=account.request_id, finish_reason=finish_reason_to_pb(item.finish_reason),
                        usage=usage_to_pb(item.usage),
                    )

    async def Complete(  # noqa: N802
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        async with self._account("Complete", context) as account, \
                aclosing(self._generate(account, request, context)) as items:
            reply = gateway_pb2.CompleteResponse(request_id=account.request_id)
            texts: list[str] = []
            async for item in items:
                if isinstance(item, Chunk):
                    texts.append(item.text_delta)
                    reply.token_ids.extend(item.token_ids)
                else:
                    reply.finish_reason = finish_reason_to_pb(item.finish_reason)
                    reply.usage.CopyFrom(usage_to_pb(item.usage))
            reply.text = "".join(texts)
            return reply

    async def SubmitFeedback(  # noqa: N802
        self, request: gateway_pb2.FeedbackRequest, context: aio.ServicerContext
    ) -> gateway_pb2.FeedbackResponse:
        """Rate one of the caller's own requests (NOT_FOUND for any other request id)."""
        caller = self.accounting.authenticate(_authorization(context))
        row = await self.accounting.feedback.rate(caller.tenant.name, request.request_id, request.rating,
                                                  request.comment)
        if row.cache_hit:  # the cache learns which of its answers were bad (issue 5's threshold)
            await self.pipeline.backends.report_cache_feedback(row.cache_entry_id, request.rating < 0,
                                                               row.cache_similarity)
        return gateway_pb2.FeedbackResponse(request_id=current_request_id())

    async def GetUsage(  # noqa: N802
        self, request: gateway_pb2.UsageRequest, context: aio.ServicerContext
    ) -> gateway_pb2.UsageResponse:
        """The caller's own totals, and by day and model, from the ledger."""
        caller = self.accounting.authenticate(_authorization(context))
        since_ms, until_ms = rfc3339_ms("since", request.since), rfc3339_ms("until", request.until)
        if since_ms is not None and until_ms is not None and until_ms < since_ms:
            raise InvalidArgument(f"until: must not be before since ({request.since}), got {request.until}")
        total, buckets = await self.accounting.usage(caller, since_ms, until_ms)
        return gateway_pb2.UsageResponse(
            total=totals_to_pb(total), tenant=caller.tenant.name, request_id=current_request_id(),
            buckets=[gateway_pb2.UsageBucket(day=b.day, model=b.model, totals=totals_to_pb(b.totals))
                     for b in buckets],
        )

    async def CountTokens(  # noqa: N802
        self, request: common_pb2.CountTokensRequest, context: aio.ServicerContext
    ) -> common_pb2.CountTokensResponse:
        self.accounting.authenticate(_authorization(context))
        kind = request.WhichOneof("input")
        validate_input(
            request.prompt if kind == "prompt" else None,
            [(m.role, m.content) for m in request.chat.messages] if kind == "chat" else None,
            self.config,
        )
        reply = await self.pipeline.count_tokens(request)
        reply.request_id = current_request_id()
        return reply


async def create_server(config: GatewayConfig) -> ServiceHandle:
    """The gateway server, bound (``config.port`` 0 = a free port) but not started."""
    handle = new_server("gateway", [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
                        config.host, config.port)
    backends = Backends(config)
    accounting = Accounting.open(config)
    pipeline = Pipeline(config, backends, accounting.prices)
    servicer = GatewayServicer(config, pipeline, accounting)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, handle.server)
    handle.on_close.append(backends.close)
    handle.on_close.append(pipeline.detokenizer.close)  # closed first (on_close runs in reverse)
    handle.on_close.append(pipeline.generations.close)
    handle.on_close.append(accounting.close)
    return handle


def main(argv: list[str] | None = None) -> None:
    run_service("gateway", GatewayConfig, create_server, argv)
