"""The inference service in-process on a free port, called over real gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.config import config_with
from aiserve.common.cpu import machine_kind, read_cpu_flags
from aiserve.common.server import ServiceHandle
from aiserve.store import Manifest, ModelStore
from aiserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.config import InferenceConfig
from services.inference.server import InferenceServicer, create_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT_S = 60.0
MAX_SEQ_LEN = 4096
LONG = 4000  # new tokens no test waits for: such a generation ends by cancel
PROMPT = [1, 9690, 198, 19556, 30, 2, 198, 1, 520, 9531, 198]  # system 'Hello.', then the assistant's turn


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def handle(store: ModelStore, two_torch_threads: None) -> AsyncIterator[ServiceHandle]:
    # one sequence at a time, so a second request queues (the deadline test below)
    config = config_with(InferenceConfig, port=0, metrics_port=0, dtype="float32", model_store=str(store.root),
                         max_num_seqs=1, kv_cache_bytes=256 << 20, max_seq_len=MAX_SEQ_LEN)
    handle = await create_server(config)
    try:
        await handle.start()
        await handle.set_serving(True)
        yield handle
    finally:
        await handle.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def channel(handle: ServiceHandle) -> AsyncIterator[aio.Channel]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        yield channel


def own_metric(handle: ServiceHandle, name: str, **labels: str) -> float | None:
    """A sample of the service's own metrics, which all carry the name@version it serves."""
    assert isinstance(handle.servicer, InferenceServicer)
    return handle.registry.get_sample_value(name, {"model": str(handle.servicer.model.ref), **labels})


def generate_request(max_new_tokens: int = 5, **fields: object) -> inference_pb2.InferenceRequest:
    decoding = inference_pb2.Decoding(max_new_tokens=max_new_tokens, ignore_eos=True)
    return inference_pb2.InferenceRequest(
        prompt_token_ids=PROMPT, decoding=decoding, **fields  # type: ignore[arg-type]
    )


async def test_generate_streams_ids_then_a_final_message(channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(generate_request(5, request_id="r-1"), timeout=TIMEOUT_S)
    messages = [m async for m in call]
    assert [m.request_id for m in messages] == ["r-1"] * 5
    assert all(len(m.token_ids) == 1 for m in messages)
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.prompt_tokens, last.completion_tokens) == (len(PROMPT), 5)
    assert last.compute_ms > 0
    # the counters are running totals on every message (a caller that stops early keeps them)
    assert [m.completion_tokens for m in messages] == [1, 2, 3, 4, 5]
    assert all(m.prompt_tokens == len(PROMPT) for m in messages)
    assert 0 < messages[0].kv_peak_bytes < last.kv_peak_bytes


async def test_stats_reports_the_engine(channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    before = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    _ = [m async for m in stub.Generate(generate_request(3), timeout=TIMEOUT_S)]
    after = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    assert after.num_generated_tokens - before.num_generated_tokens == 3
    assert after.num_steps > before.num_steps and after.prefix_lookups > before.prefix_lookups
    assert (after.num_running, after.num_waiting, after.max_num_seqs) == (0, 0, 1)
    assert after.kv_total_bytes == after.kv_used_bytes + after.kv_free_bytes > 0
    assert 0 < after.kv_share_of_rss < 1 and after.rss_bytes > after.kv_total_bytes


async def test_confirmed_drafts_arrive_as_several_ids_and_are_counted(
        handle: ServiceHandle, channel: aio.Channel) -> None:
    """Speculative decoding (on by default for greedy requests) over gRPC: a prompt that
    repeats itself gets drafts, a message may carry several ids, Stats counts them."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    before = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    phrase = [504, 3458, 282, 260, 6370, 314, 7042, 30, 198]  # a phrase, said four times
    request = inference_pb2.InferenceRequest(
        prompt_token_ids=phrase * 4, decoding=inference_pb2.Decoding(max_new_tokens=18, ignore_eos=True))
    messages = [m async for m in stub.Generate(request, timeout=TIMEOUT_S)]
    after = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    assert sum(len(m.token_ids) for m in messages) == messages[-1].completion_tokens == 18
    assert max(len(m.token_ids) for m in messages) > 1 and len(messages) < 18
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    assert accepted == 18 - len(messages)  # each message is one step: one id + its confirmed drafts
    assert after.num_draft_tokens - before.num_draft_tokens >= accepted
    # the Prometheus view reads the same snapshot
    accepted_total = own_metric(handle, "aiserve_inference_accepted_draft_tokens_total")
    drafted_total = own_metric(handle, "aiserve_inference_draft_tokens_total")
    assert accepted_total is not None and accepted_total >= after.num_accepted_draft_tokens
    assert drafted_total is not None and drafted_total >= after.num_draft_tokens > 0


async def test_request_id_defaults_to_the_metadata_one(channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(generate_request(2), timeout=TIMEOUT_S,
                         metadata=(("x-request-id", "from-metadata"),))
    assert {m.request_id async for m in call} == {"from-metadata"}


async def test_info_reports_what_is_loaded(channel: aio.Channel, manifest: Manifest) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=TIMEOUT_S)
    assert info.model == str(manifest.ref)
    assert info.tokenizer_sha256 == manifest.tokenizer_sha256
    assert (info.device, info.dtype) == ("cpu", "float32")
    # what this engine accepts: min(model context 8192, max_seq_len)
    assert (info.context_length, info.vocab_size, list(info.eos_token_ids)) == (MAX_SEQ_LEN, 49152, [2])


async def test_the_precision_is_reported_by_info_stats_and_a_metric(handle: ServiceHandle,
                                                                     channel: aio.Channel) -> None:
    """dtype=float32 was set, matmul_dtype left "auto": float32 throughout, on this CPU's kind."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    info = await stub.Info(inference_pb2.InferenceInfoRequest(), timeout=TIMEOUT_S)
    stats = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    p, flags = info.precision, read_cpu_flags()
    assert (p.weights_dtype, p.matmul_dtype, p.kv_dtype) == ("float32", "float32", "float32")
    assert p.cpu_kind == machine_kind("cpu", flags) and set(p.cpu_flags) <= flags
    assert p.reason.startswith(p.cpu_kind + ": ") and "dtype=float32 set" in p.reason
    # make builds our CPU ops, and both CPU kinds we serve on have AVX2 + FMA
    assert (p.native_ops, p.native_ops_reason) == ("on", "on: built for avx2+fma, CPU has them")
    assert stats.precision == p
    labels = {"weights": "float32", "matmul": "float32", "kv": "float32", "cpu": p.cpu_kind, "native_ops": "on"}
    assert own_metric(handle, "aiserve_inference_precision", **labels) == 1


async def test_steps_health_and_the_process_are_exported_with_the_model(handle: ServiceHandle,
                                                                         channel: aio.Channel) -> None:
    """A generation's steps land in the step histograms; a health check in its gauges; the
    process collector beside them; no GPU gauge on a CPU."""
    steps_before = own_metric(handle, "aiserve_inference_step_seconds_count") or 0
    tokens_before = own_metric(handle, "aiserve_inference_step_tokens_sum") or 0
    [m async for m in inference_pb2_grpc.InferenceStub(channel).Generate(generate_request(3), timeout=TIMEOUT_S)]
    steps = own_metric(handle, "aiserve_inference_step_seconds_count")
    assert steps is not None and steps - steps_before >= 3  # one prefill, then a decode step per token
    assert steps == own_metric(handle, "aiserve_inference_steps_total")  # the same steps
    assert own_metric(handle, "aiserve_inference_step_seconds_bucket", le="+Inf") == steps
    assert (own_metric(handle, "aiserve_inference_step_seconds_sum") or 0) > 0
    # the prompt's tokens in its prefill, then one per decode step (drafts may add some)
    assert (own_metric(handle, "aiserve_inference_step_tokens_sum") or 0) - tokens_before >= len(PROMPT) + 2
    servicer = handle.servicer
    assert isinstance(servicer, InferenceServicer) and servicer.health is not None
    assert (await servicer.health.check()).is_serving
    assert own_metric(handle, "aiserve_inference_health_check_passed") == 1
    assert (own_metric(handle, "aiserve_inference_health_check_timestamp_seconds") or 0) > 0
    assert (handle.registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
    assert own_metric(handle, "aiserve_inference_gpu_memory_allocated_bytes") is None
    used, total = (own_metric(handle, f"aiserve_inference_kv_{k}_bytes") for k in ("used", "total"))
    assert used is not None and total and own_metric(handle, "aiserve_inference_kv_usage_ratio") == used / total


async def test_another_model_is_not_found(channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    with pytest.raises(aio.AioRpcError) as caught:
        async for _ in stub.Generate(generate_request(model="other@9.9"), timeout=TIMEOUT_S):
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_empty_prompt_is_invalid_argument(channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    request = inference_pb2.InferenceRequest(decoding=inference_pb2.Decoding(max_new_tokens=4))
    with pytest.raises(aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, timeout=TIMEOUT_S):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in (caught.value.details() or "")


async def test_health_answers_while_a_long_generation_streams(handle: ServiceHandle, channel: aio.Channel) -> None:
    stub = inference_pb2_grpc.InferenceStub(channel)
    assert isinstance(servicer := handle.servicer, InferenceServicer)
    engine = servicer.engine
    before = engine.stats()
    long_call = stub.Generate(generate_request(LONG), timeout=TIMEOUT_S)
    try:
        await long_call.read()  # the model is busy now
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert engine.stats().num_running == 1  # answered while the generation still ran
        # A queued request whose deadline passes fails and never runs.
        with pytest.raises(aio.AioRpcError) as caught:
            async for _ in stub.Generate(generate_request(2), timeout=0.5):
                pass
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        long_call.cancel()
    # The cancelled generation left the model: a new request runs to its end ...
    messages = [m async for m in stub.Generate(generate_request(2), timeout=TIMEOUT_S)]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # ... long before the LONG tokens it asked for
    assert engine.stats().num_generated_tokens - before.num_generated_tokens < LONG
