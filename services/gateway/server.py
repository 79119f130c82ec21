"""The public Gateway service: thin RPCs over the pipeline (pb <-> domain here, nowhere else)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from grpc import aio
from prometheus_client import Counter

from aiserve.common.config import load_config
from aiserve.common.context import current_request_id
from aiserve.common.logging import configure_logging, get_logger
from aiserve.common.server import ServiceHandle, new_server, serve, start_metrics
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.backends import Backends
from services.gateway.config import GatewayConfig
from services.gateway.pipeline import (
    FINISH_TO_PB,
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
    )


def usage_to_pb(usage: UsageRecord) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cache_hit=usage.cache_hit, queue_ms=usage.queue_ms, ttft_ms=usage.ttft_ms,
        total_ms=usage.total_ms, model=usage.model, cost_micros=usage.cost_micros,
        cache_similarity=usage.cache_similarity,
    )


def _record(final: Final) -> None:
    REQUESTS.labels(final.finish_reason, str(final.usage.cache_hit).lower()).inc()
    TOKENS.labels("prompt").inc(final.usage.prompt_tokens)
    TOKENS.labels("completion").inc(final.usage.completion_tokens)
    log.info("generation_finished", finish_reason=final.finish_reason,
             prompt_tokens=final.usage.prompt_tokens, completion_tokens=final.usage.completion_tokens,
             cache_hit=final.usage.cache_hit, ttft_ms=final.usage.ttft_ms, total_ms=final.usage.total_ms,
             cost_micros=final.usage.cost_micros)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate, Complete and CountTokens (DESIGN.md §3)."""

    def __init__(self, config: GatewayConfig, pipeline: Pipeline) -> None:
        self.config = config
        self.pipeline = pipeline

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        req = request_from_pb(request, self.config)
        async for item in self.pipeline.generate(req, context.time_remaining()):
            if isinstance(item, Chunk):
                yield gateway_pb2.GenerateResponse(
                    request_id=req.request_id, text_delta=item.text_delta, token_ids=item.token_ids
                )
            else:
                _record(item)
                yield gateway_pb2.GenerateResponse(
                    request_id=req.request_id, finish_reason=FINISH_TO_PB[item.finish_reason],
                    usage=usage_to_pb(item.usage),
                )

    async def Complete(  # noqa: N802
        self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> gateway_pb2.CompleteResponse:
        req = request_from_pb(request, self.config)
        reply = gateway_pb2.CompleteResponse(request_id=req.request_id)
        texts: list[str] = []
        async for item in self.pipeline.generate(req, context.time_remaining()):
            if isinstance(item, Chunk):
                texts.append(item.text_delta)
                reply.token_ids.extend(item.token_ids)
            else:
                _record(item)
                reply.finish_reason = FINISH_TO_PB[item.finish_reason]
                reply.usage.CopyFrom(usage_to_pb(item.usage))
        reply.text = "".join(texts)
        return reply

    async def CountTokens(  # noqa: N802
        self, request: common_pb2.CountTokensRequest, context: aio.ServicerContext
    ) -> common_pb2.CountTokensResponse:
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
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(config, Pipeline(config, backends)), handle.server)
    handle.on_close.append(backends.close)
    return handle


def main(argv: list[str] | None = None) -> None:
    config = load_config(GatewayConfig, "gateway", sys.argv[1:] if argv is None else argv)
    configure_logging("gateway", config.log_level)
    start_metrics(config.metrics_port)

    async def run() -> None:
        await serve(await create_server(config), config.grace_s)

    asyncio.run(run())
