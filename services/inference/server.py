"""The inference gRPC service: a thin servicer over the engine, plus create_server and main."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence

import torch
from grpc import aio
from prometheus_client import Counter, Gauge

from aiserve.common.config import ConfigError, load_config
from aiserve.common.context import current_request_id
from aiserve.common.errors import NotFound
from aiserve.common.logging import configure_logging, get_logger
from aiserve.common.server import ServiceHandle, new_server, serve, start_metrics
from aiserve.store import ModelRef, ModelStore, ModelStoreError
from aiserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.config import InferenceConfig
from services.inference.engine import Engine, GenerateRequest, TokenEvent
from services.inference.model import LoadedModel, load_model
from services.inference.sampler import SamplingParams

log = get_logger("inference")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
QUEUE_LENGTH = Gauge("aiserve_inference_queue_length", "Requests waiting for the model")
GENERATED_TOKENS = Counter("aiserve_inference_generated_tokens", "Tokens generated and streamed")

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def from_pb(request: inference_pb2.InferenceRequest, deadline: float | None) -> GenerateRequest:
    """pb -> domain. proto3 zeros of top_p and repetition_penalty (unset) mean "off"."""
    d = request.decoding
    params = SamplingParams(
        temperature=d.temperature,
        top_p=d.top_p or 1.0,
        top_k=d.top_k,
        repetition_penalty=d.repetition_penalty or 1.0,
        seed=d.seed if d.HasField("seed") else None,
    )
    return GenerateRequest(
        request_id=request.request_id or current_request_id(),
        prompt_token_ids=tuple(request.prompt_token_ids),
        params=params,
        max_new_tokens=d.max_new_tokens,
        stop_token_ids=frozenset(d.stop_token_ids),
        ignore_eos=d.ignore_eos,
        priority=request.priority,
        deadline=deadline,
    )


def to_pb(request_id: str, event: TokenEvent) -> inference_pb2.InferenceResponse:
    """domain -> pb; the counters go on the last message only."""
    response = inference_pb2.InferenceResponse(request_id=request_id, token_ids=event.token_ids)
    if event.finish_reason is not None:
        response.finish_reason = _FINISH[event.finish_reason]
        response.prompt_tokens = event.prompt_tokens
        response.completion_tokens = event.completion_tokens
        response.queue_ms = round(event.queue_ms)
        response.compute_ms = round(event.compute_ms)
    return response


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """aiserve.v1.Inference over one loaded model and its engine."""

    def __init__(self, engine: Engine, model: LoadedModel) -> None:
        self.engine = engine
        self.model = model

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.InferenceRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """Stream the ids of one generation, one message per token; the last one carries
        finish_reason and the counters. Cancelling the call cancels the generation."""
        if request.model and request.model != str(self.model.ref):
            raise NotFound(f"model: {request.model!r} is not loaded here (this is {self.model.ref})")
        remaining_s = context.time_remaining()
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        domain = from_pb(request, deadline)
        async for event in self.engine.generate(domain):
            GENERATED_TOKENS.inc(len(event.token_ids))
            yield to_pb(domain.request_id, event)

    async def Info(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.InferenceInfoRequest, context: aio.ServicerContext
    ) -> inference_pb2.InferenceInfo:
        """What is loaded: model, tokenizer fingerprint, device, dtype, context and vocab sizes."""
        m = self.model
        return inference_pb2.InferenceInfo(
            model=str(m.ref), tokenizer_sha256=m.tokenizer_sha256, device=m.device_name,
            dtype=m.dtype_name, context_length=m.context_length, vocab_size=m.vocab_size,
            eos_token_ids=sorted(m.eos_token_ids),
        )


async def warm_up(engine: Engine) -> None:
    """One short generation, so the first real request pays no first-call costs."""
    request = GenerateRequest(request_id="warm-up", prompt_token_ids=(0,), max_new_tokens=2,
                              ignore_eos=True)
    async for _ in engine.generate(request):
        pass


async def create_server(config: InferenceConfig) -> ServiceHandle:
    """Verify and load the model, start and warm up the engine, and build the (unstarted)
    server. ModelStoreError propagates (missing or tampered model)."""
    folder, manifest = ModelStore(config.model_store_path()).load_path(ModelRef.parse(config.model))
    model = await asyncio.to_thread(load_model, folder, manifest, config.device, config.dtype)
    engine = Engine(model, config.max_queue, config.max_new_tokens_limit)
    engine.start()
    try:
        await warm_up(engine)
        handle = new_server("inference", [SERVICE_NAME], config.host, config.port)
    except BaseException:
        await engine.stop()
        raise
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(engine, model), handle.server)
    handle.on_close.append(engine.stop)
    QUEUE_LENGTH.set_function(lambda: engine.num_waiting)
    log.info("model_loaded", model=str(model.ref), device=model.device_name, dtype=model.dtype_name)
    return handle


async def _run(config: InferenceConfig) -> None:
    handle = await create_server(config)
    await serve(handle, config.grace_s)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: settings, logging, torch threads, metrics, then serve until SIGTERM."""
    try:
        config = load_config(InferenceConfig, "inference", sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"aiserve-inference: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging("inference", config.log_level)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    start_metrics(config.metrics_port)
    try:
        asyncio.run(_run(config))
    except ModelStoreError as exc:
        print(f"aiserve-inference: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
