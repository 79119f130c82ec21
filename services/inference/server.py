"""The inference gRPC service: a thin servicer over the batching engine, plus create_server and main.

Its health is SERVING only while its checks pass (health.py: the engine's probe, free memory);
its Status rpc reports the model, the queue, the batch and the KV cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

import torch
from grpc import aio
from prometheus_client import Gauge
from prometheus_client.registry import CollectorRegistry

from aiserve.common.errors import NotFound
from aiserve.common.interceptors import RpcMetrics
from aiserve.common.logging import get_logger, log_startup
from aiserve.common.server import ServiceHandle, new_server, rss_bytes, run_service
from aiserve.store import ModelRef, ModelStore
from aiserve.v1 import inference_pb2, inference_pb2_grpc, status_pb2
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine, machine_precision
from services.inference.engine_stats import EngineStats
from services.inference.generate_mux_server import MuxCall
from services.inference.health import InferenceHealth, free_memory_bytes
from services.inference.health_probe import device_free_bytes
from services.inference.messages import from_pb, to_pb
from services.inference.metrics import DeviceCollector, EngineCollector, WithLabels, cuda_figures
from services.inference.model import ModelInfo
from services.inference.precision import Precision
from services.inference.request import GenerateRequest
from services.inference.torch_thread import in_fresh_thread

log = get_logger("inference")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


def precision_to_pb(p: Precision) -> inference_pb2.InferencePrecision:
    """domain -> pb for Info and Stats."""
    return inference_pb2.InferencePrecision(weights_dtype=p.weights, matmul_dtype=p.matmul, kv_dtype=p.kv,
                                            cpu_kind=p.cpu, cpu_flags=p.cpu_flags, reason=p.reason,
                                            native_ops=p.native_ops, native_ops_reason=p.native_ops_reason)


def export_precision(p: Precision, registry: CollectorRegistry) -> None:
    """``aiserve_inference_precision{weights,matmul,kv,cpu,native_ops} 1``: the dtypes, the machine
    kind and whether our CPU ops run, as an info-style gauge."""
    gauge = Gauge("aiserve_inference_precision",
                  "1, labelled with the dtypes the model runs in, the machine kind and whether our CPU ops run",
                  ["weights", "matmul", "kv", "cpu", "native_ops"], registry=registry)
    gauge.labels(weights=p.weights, matmul=p.matmul, kv=p.kv, cpu=p.cpu, native_ops=p.native_ops).set(1)


def stats_to_pb(s: EngineStats, max_num_seqs: int, rss: int, precision: Precision) -> inference_pb2.InferenceStats:
    """domain -> pb for the Stats RPC (``rss``: this process's resident bytes)."""
    return inference_pb2.InferenceStats(
        num_running=s.num_running, num_waiting=s.num_waiting, kv_total_bytes=s.kv_total_bytes,
        kv_used_bytes=s.kv_used_bytes, kv_free_bytes=s.kv_free_bytes,
        kv_share_of_rss=s.kv_total_bytes / rss if rss else 0.0, rss_bytes=rss,
        prefix_lookups=s.prefix_lookups, prefix_hits=s.prefix_hits, prefix_hit_tokens=s.prefix_hit_tokens,
        num_steps=s.num_steps, num_generated_tokens=s.num_generated_tokens, num_preemptions=s.num_preemptions,
        max_num_seqs=max_num_seqs, num_draft_tokens=s.num_draft_tokens,
        num_accepted_draft_tokens=s.num_accepted_draft_tokens, num_requests=s.num_requests,
        precision=precision_to_pb(precision),
    )


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """aiserve.v1.Inference over one loaded model and its engine."""

    def __init__(self, engine: BatchEngine, model: ModelInfo, metrics: RpcMetrics) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics
        self._muxes: set[MuxCall] = set()
        self._is_stopping = False
        self._requests_before = engine.stats().num_requests  # the warm-up's: not the clients'
        self.health: InferenceHealth | None = None
        """The service's health loop (set by create_server; tests run a check of their own)."""

    def stop_muxes(self) -> None:
        """The service is stopping: GenerateMux calls refuse new streams (UNAVAILABLE) and end
        once their running streams are done, within the grace period Generate calls get."""
        self._is_stopping = True
        for mux in self._muxes:
            mux.stop()

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.InferenceRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """Stream the ids of one generation, one message per token, each with the running
        counters; the last one carries finish_reason. Cancelling the call cancels the
        generation: it leaves the batch at the next step and its KV slot is freed."""
        if request.model and request.model != str(self.model.ref):
            raise NotFound(f"model: {request.model!r} is not loaded here (this is {self.model.ref})")
        remaining_s = context.time_remaining()
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        domain = from_pb(request, deadline)
        async for event in self.engine.generate(domain):
            yield to_pb(domain.request_id, event)

    async def GenerateMux(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[inference_pb2.GenerateMuxRequest], context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateMuxResponse]:
        """Generate for many generations over one call; each step's events in one message
        (generate_mux_server.py)."""
        mux = MuxCall(self.engine, str(self.model.ref), self.metrics)
        if self._is_stopping:
            mux.stop()
        self._muxes.add(mux)
        try:
            async for reply in mux.run(request_iterator):
                yield reply
        finally:
            self._muxes.discard(mux)

    async def Info(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.InferenceInfoRequest, context: aio.ServicerContext
    ) -> inference_pb2.InferenceInfo:
        """What is loaded: model, tokenizer fingerprint, device, precision, context and vocab sizes."""
        m = self.model
        return inference_pb2.InferenceInfo(
            model=str(m.ref), tokenizer_sha256=m.tokenizer_sha256, device=m.device,
            dtype=m.precision.weights, context_length=m.context_length, vocab_size=m.vocab_size,
            eos_token_ids=sorted(m.eos_token_ids), precision=precision_to_pb(m.precision),
        )

    async def Stats(  # noqa: N802 - gRPC method name
        self, request: inference_pb2.InferenceStatsRequest, context: aio.ServicerContext
    ) -> inference_pb2.InferenceStats:
        """A snapshot of the engine (batch, queue, KV, prefix reuse, totals); no model work."""
        s = self.engine.stats()
        s = dataclasses.replace(s, num_requests=s.num_requests - self._requests_before)
        return stats_to_pb(s, self.engine.scheduler.capacity, rss_bytes(), self.model.precision)

    def figures(self) -> status_pb2.ServiceStatus:
        """This service's part of its Status rpc: the model, the queue, the batch, the KV cache."""
        s = self.engine.stats()
        return status_pb2.ServiceStatus(model=str(self.model.ref), queue_length=s.num_waiting,
                                        running=s.num_running, kv_used_bytes=s.kv_used_bytes,
                                        kv_total_bytes=s.kv_total_bytes)


def model_metrics(engine: BatchEngine, precision: Precision, registry: CollectorRegistry,
                  model: str) -> CollectorRegistry:
    """The registry of this service's own metrics (the engine's, the precision, the GPU's on
    CUDA; the health loop adds its own), exported through ``registry`` with the label
    ``model=<name@version>`` on every sample."""
    own = CollectorRegistry()
    own.register(EngineCollector(engine))
    device = engine.model.device
    if device.type == "cuda":
        own.register(DeviceCollector(lambda: cuda_figures(device)))
    export_precision(precision, own)
    registry.register(WithLabels(own, {"model": model}))
    return own


async def warm_up(engine: BatchEngine) -> None:
    """One short generation, so the first real request pays no first-call costs."""
    request = GenerateRequest(request_id="warm-up", prompt_token_ids=(0,), max_new_tokens=2,
                              ignore_eos=True)
    async for _ in engine.generate(request):
        pass


async def create_server(config: InferenceConfig) -> ServiceHandle:
    """Verify and load the model, start and warm up the engine, and build the (unstarted)
    server. ModelStoreError propagates (missing or tampered model)."""
    folder, manifest = ModelStore(config.model_store_path()).load_path(ModelRef.parse(config.model))
    log_startup("verified")
    precision = machine_precision(config)
    log.info("precision_chosen", cpu=precision.cpu, cpu_flags=list(precision.cpu_flags), weights=precision.weights,
             matmul=precision.matmul, kv=precision.kv, reason=precision.reason, native_ops=precision.native_ops,
             native_ops_reason=precision.native_ops_reason, draft_step_tokens=precision.draft_step_tokens)
    # torch runs on one thread per process (torch_thread.py): load on a thread that then exits
    engine = await in_fresh_thread(lambda: build_engine(config, folder, precision), name="model-load")
    log_startup("loaded")
    c = engine.model.config
    model = ModelInfo(manifest.ref, manifest.tokenizer_sha256, str(engine.model.device), precision,
                      engine.scheduler.slot_len, c.vocab_size, engine.eos_ids)
    engine.start()
    try:
        await warm_up(engine)
        log_startup("warmed")
        handle = new_server("inference", [SERVICE_NAME], config.host, config.port)
    except BaseException:
        await engine.stop()
        raise
    servicer = InferenceServicer(engine, model, handle.rpc_metrics)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, handle.server)
    handle.servicer = servicer
    handle.figures = servicer.figures
    handle.on_stopping.append(servicer.stop_muxes)
    handle.on_close.append(engine.stop)
    own = model_metrics(engine, precision, handle.registry, str(model.ref))
    health = InferenceHealth(config.health, engine.probe,
                             lambda: free_memory_bytes(lambda: device_free_bytes(engine.model.device)),
                             engine.step_errors(), handle.set_serving, own)
    handle.health_loop, servicer.health = health.run, health
    if engine.scheduler.capacity < config.engine.scheduler.max_num_seqs:
        log.warning("kv_cache_caps_batch", max_num_seqs=config.engine.scheduler.max_num_seqs,
                    kv_slots=engine.scheduler.capacity, kv_cache_bytes=config.engine.kv_cache.kv_cache_bytes,
                    max_seq_len=engine.scheduler.slot_len)
    plan = engine.cache.plan
    log.info("model_loaded", model=str(model.ref), device=model.device, dtype=precision.weights,
             matmul_dtype=precision.matmul, packed_weights=engine.model.packed_weights,
             native_ops=precision.native_ops, native_ops_reason=precision.native_ops_reason,
             max_num_seqs=engine.scheduler.capacity, max_seq_len=engine.scheduler.slot_len,
             kv_cache_bytes=engine.cache.total_bytes, kv_slots=plan.num_slots, kv_prefix_blocks=plan.num_blocks,
             kv_sized_from="kv_cache_bytes" if config.engine.kv_cache.kv_cache_bytes else "max_num_seqs")
    return handle


def _set_threads(config: InferenceConfig) -> None:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the inference service until SIGTERM/SIGINT. Exit code 2 on bad settings or model."""
    run_service("inference", InferenceConfig, create_server, argv, prepare=_set_threads)
