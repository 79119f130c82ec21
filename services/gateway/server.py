"""The public Gateway service: thin RPCs over the pipeline and the accounting.

The edge: each RPC reads its metadata, converts pb -> domain (``messages.py``, validating),
calls the core (``Accounting``, ``Pipeline``) and converts the answer back. No other module of
the core sees pb or grpc.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from grpc import aio

from aiserve.common.context import AUTHORIZATION_KEY, SESSION_KEY, current_request_id, traceparent_var
from aiserve.common.logging import get_logger
from aiserve.common.server import ServiceHandle, new_server, run_service
from aiserve.v1 import admin_pb2, common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.accounting import Accounting, RequestAccount
from services.gateway.admin import add_admin
from services.gateway.backends import Backends
from services.gateway.canary import CanaryWatch
from services.gateway.config import GatewayConfig
from services.gateway.domain import CallInfo, Chunk, Final
from services.gateway.http import add_http
from services.gateway.interfaces import RequestObserver
from services.gateway.messages import (
    chunk_to_pb,
    complete_to_pb,
    count_request_from_pb,
    count_to_pb,
    final_to_pb,
    request_from_pb,
    usage_response_to_pb,
)
from services.gateway.metrics import GatewayMetrics, ReplicaCollector
from services.gateway.pipeline import Pipeline
from services.gateway.route_store import RouteStore
from services.gateway.validation import usage_period

log = get_logger("gateway")


def _metadata(context: aio.ServicerContext, key: str) -> str:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == key), "")


def _authorization(context: aio.ServicerContext) -> str:
    return _metadata(context, AUTHORIZATION_KEY)


def _call_info(context: aio.ServicerContext) -> CallInfo:
    return CallInfo(_authorization(context), _metadata(context, SESSION_KEY), context.time_remaining())


def _log_finished(final: Final) -> None:
    usage = final.usage
    log.info("generation_finished", finish_reason=final.finish_reason, prompt_tokens=usage.prompt_tokens,
             completion_tokens=usage.completion_tokens, cache_hit=usage.cache_hit, ttft_ms=usage.ttft_ms,
             total_ms=usage.total_ms, compute_ms=usage.compute_ms, cost_micros=usage.cost_micros)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate, Complete, CountTokens, SubmitFeedback and GetUsage (protos/aiserve/v1/gateway.proto)."""

    def __init__(self, config: GatewayConfig, pipeline: Pipeline, accounting: Accounting,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.pipeline = pipeline
        self.accounting = accounting
        self.metrics = metrics

    async def responses(self, api: str, request: gateway_pb2.GenerateRequest, call: CallInfo,
                        ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """One generation as the public messages: its chunks, then the last one (with usage)
        once its ledger row is committed. Generate's body, and the HTTP door's (one pipeline)."""
        async with self.accounting.account(api, current_request_id(), traceparent_var.get(), call.timeout_s,
                                           call.user) as account, \
                aclosing(self._generate(account, request, call)) as items:
            async for item in items:
                if isinstance(item, Chunk):
                    yield chunk_to_pb(item, account.request_id)
                else:
                    yield final_to_pb(item, account.request_id)

    async def _generate(self, account: RequestAccount, request: gateway_pb2.GenerateRequest,
                        call: CallInfo) -> AsyncGenerator[Chunk | Final, None]:
        """Authenticate, validate, admit, generate; the Final comes after its row is committed."""
        account.authenticate(call.authorization)
        checked = request_from_pb(request, self.config, account.request_id)
        req = account.admit(replace(checked, session=call.session))
        async with aclosing(self.pipeline.generate(req, call.timeout_s, account.reserve)) as items:
            async for item in items:
                if isinstance(item, Chunk):
                    account.streamed(len(item.token_ids))
                else:
                    await account.finish(item)
                    self.metrics.record(item)
                    _log_finished(item)
                yield item

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with aclosing(self.responses("Generate", request, _call_info(context))) as replies:
            async for reply in replies:
                yield reply

    async def Complete(  # noqa: N802
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        call = _call_info(context)
        async with self.accounting.account("Complete", current_request_id(), traceparent_var.get(),
                                           call.timeout_s) as account, \
                aclosing(self._generate(account, request, call)) as items:
            chunks: list[Chunk] = []
            final: Final | None = None
            async for item in items:
                if isinstance(item, Chunk):
                    chunks.append(item)
                else:
                    final = item
            return complete_to_pb(chunks, final, account.request_id)

    async def SubmitFeedback(  # noqa: N802
        self, request: gateway_pb2.FeedbackRequest, context: aio.ServicerContext
    ) -> gateway_pb2.FeedbackResponse:
        """Rate one of the caller's own requests (NOT_FOUND for any other request id)."""
        caller = self.accounting.authenticate(_authorization(context))
        row = await self.accounting.feedback.rate(caller.tenant.name, request.request_id, request.rating,
                                                  request.comment)
        self.pipeline.observer.rated(row.model, request.rating < 0)  # the version's figures
        if row.cache_hit:  # the cache learns which of its answers were bad (it may evict them)
            await self.pipeline.report_cache_feedback(row.cache_entry_id, request.rating < 0, row.cache_similarity)
        return gateway_pb2.FeedbackResponse(request_id=current_request_id())

    async def GetUsage(  # noqa: N802
        self, request: gateway_pb2.UsageRequest, context: aio.ServicerContext
    ) -> gateway_pb2.UsageResponse:
        """The caller's own totals, and by day and model, from the ledger."""
        caller = self.accounting.authenticate(_authorization(context))
        since_ms, until_ms = usage_period(request.since, request.until)
        total, buckets = await self.accounting.usage(caller, since_ms, until_ms)
        return usage_response_to_pb(caller.tenant.name, total, buckets, current_request_id())

    async def CountTokens(  # noqa: N802
        self, request: common_pb2.CountTokensRequest, context: aio.ServicerContext
    ) -> common_pb2.CountTokensResponse:
        self.accounting.authenticate(_authorization(context))
        count = await self.pipeline.count_tokens(count_request_from_pb(request, self.config))
        return count_to_pb(count, current_request_id())


async def create_server(config: GatewayConfig, observer: RequestObserver | None = None) -> ServiceHandle:
    """The gateway server, bound (``config.port`` 0 = a free port) but not started; ``observer``
    sees every finished request and gives Admin the versions' figures (None: the canary
    judgement's window, services/gateway/canary.py)."""
    handle = new_server("gateway", [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
                                    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name],
                        config.host, config.port)
    metrics = GatewayMetrics(handle.registry, config)
    backends = Backends(config, metrics.set_cache_available, RouteStore(config.routes_file()))
    canaries = CanaryWatch(config.judge, handle.registry)
    handle.registry.register(ReplicaCollector(backends.pools))

    async def loops() -> None:  # while it serves: health follows the backends; canaries are judged
        await asyncio.gather(backends.health_loop(handle.set_serving),
                             canaries.run(lambda: backends.routes.table, backends.routes.rollback))

    handle.health_loop = loops
    accounting = Accounting.open(config, metrics.count_call, metrics.count_feedback)
    observer = observer if observer is not None else canaries.observer
    pipeline = Pipeline(config, backends.pipeline, accounting.prices, observer, metrics.count_cache_lookup)
    servicer = GatewayServicer(config, pipeline, accounting, metrics)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, handle.server)
    add_admin(handle, config.admin_key_file(), backends, accounting, observer)
    handle.servicer = servicer
    if config.http_port:
        add_http(handle, config, servicer, backends)
    handle.on_close.append(backends.close)  # closed last (on_close runs in reverse)
    handle.on_close.append(accounting.close)
    return handle


def main(argv: list[str] | None = None) -> None:
    run_service("gateway", GatewayConfig, create_server, argv)
