"""The cache service in-process over real gRPC (port 0), with the real embedding model, real
SQLite and real faiss, and a deadline on every call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from aiserve.common.cpu import read_cpu_flags
from aiserve.common.server import ServiceHandle
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.component_config import DEFAULT_SIMILARITY_THRESHOLD
from services.cache.embedder import Embedder
from services.cache.entry import CacheScope
from services.cache.metrics import CacheMetrics
from services.cache.precision import choose_dtype
from services.cache.server import CacheServicer, create_server, open_semantic_cache
from tests.unit.cache.support import SCOPE_PB, STOP, TIMEOUT_S, Q, config_for, lookup, store, store_messages


@pytest.fixture
async def handle(tmp_path: Path, embedder: Embedder) -> AsyncIterator[ServiceHandle]:
    handle = await create_server(config_for(tmp_path), embedder)
    try:
        await handle.start()
        yield handle
    finally:
        await handle.stop(0)


@pytest.fixture
async def stub(handle: ServiceHandle) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        yield cache_pb2_grpc.CacheStub(channel)


class HeldReplacement(CacheMetrics):
    """The service's metrics, whose removal hook holds a replacing commit inside its SQLite
    transaction (in the worker thread) until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.replacing = asyncio.Event()
        self.release = threading.Event()

    def count_removal(self, reason: str, ids: Sequence[int]) -> None:
        super().count_removal(reason, ids)
        if reason == "replace":
            self.loop.call_soon_threadsafe(self.replacing.set)
            assert self.release.wait(TIMEOUT_S), "the test never released the commit"


async def test_a_streamed_answer_is_found_exactly_and_replayed_delta_by_delta(stub: cache_pb2_grpc.CacheStub) -> None:
    entry_id = await store(stub, store_messages())
    reply = await lookup(stub, Q)
    assert reply.hit and reply.tier == cache_pb2.MATCH_TIER_EXACT and reply.similarity == 1.0
    assert (reply.text, list(reply.token_ids), reply.entry_id) == ("Paris.", [12, 7], entry_id)
    assert [(d.text, list(d.token_ids)) for d in reply.deltas] == [("Paris", [12]), (".", [7])]
    assert reply.finish_reason == STOP


async def test_a_paraphrase_hits_by_meaning_and_another_fact_does_not(stub: cache_pb2_grpc.CacheStub) -> None:
    await store(stub, store_messages())
    reply = await lookup(stub, "Which city is the capital of France?")
    assert reply.hit and reply.tier == cache_pb2.MATCH_TIER_SEMANTIC
    assert DEFAULT_SIMILARITY_THRESHOLD <= reply.similarity < 1.0
    assert reply.text == "Paris." and len(reply.deltas) == 2
    assert not (await lookup(stub, "What is the capital of Germany?")).hit
    assert not (await lookup(stub, "法国的首都是哪里？")).hit
    # A stricter threshold from the request; a looser one leaves the default in force.
    assert not (await lookup(stub, "Which city is the capital of France?", min_similarity=0.999)).hit
    assert not (await lookup(stub, "Tell me about France.", min_similarity=0.1)).hit  # ~0.69
    other_tenant = cache_pb2.CacheScope(model=SCOPE_PB.model, tenant="globex", params=SCOPE_PB.params)
    miss = await lookup(stub, Q, scope=other_tenant)
    assert not miss.hit and (miss.text, miss.entry_id, miss.similarity) == ("", "", 0.0)


async def test_request_id_is_echoed_in_initial_metadata(stub: cache_pb2_grpc.CacheStub) -> None:
    call = stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE_PB, prompt="Hello?"),
                       metadata=(("x-request-id", "req-cache-1"),), timeout=TIMEOUT_S)
    assert not (await call).hit
    metadata = await call.initial_metadata()
    assert metadata.get("x-request-id") == "req-cache-1"


@pytest.mark.parametrize(("messages", "field", "outcome"), [
    (store_messages(finish=common_pb2.FINISH_REASON_CANCELLED), "finish_reason", "refused"),
    (store_messages(finish=common_pb2.FINISH_REASON_ERROR), "finish_reason", "refused"),
    (store_messages()[:-1], "finish", "abandoned"),  # ended without a finish: the generation never finished
    (store_messages()[1:], "header", "refused"),  # no header
    (store_messages() + store_messages()[-1:], "finish", "refused"),  # something after the finish
    (store_messages(deltas=[("x" * 700, [1])] * 3), "entry", "refused"),  # over max_entry_bytes
])
async def test_a_stream_that_did_not_finish_normally_stores_nothing(
    tmp_path: Path, embedder: Embedder, messages: list[cache_pb2.StoreRequest], field: str, outcome: str
) -> None:
    handle = await create_server(config_for(tmp_path, max_entry_bytes=2048), embedder)
    try:
        await handle.start()
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = cache_pb2_grpc.CacheStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                await store(stub, messages)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(f"{field}:")
            assert not (await lookup(stub, Q)).hit
            # The handler ended before the status was sent, so its outcome is counted by now.
            assert handle.registry.get_sample_value("aiserve_cache_stores_total", {"outcome": outcome}) == 1
    finally:
        await handle.stop(0)


async def test_a_cancelled_store_stream_keeps_nothing(
    tmp_path: Path, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = await create_server(config_for(tmp_path), embedder)
    finished: asyncio.Queue[tuple[str, grpc.StatusCode]] = asyncio.Queue()
    record = handle.rpc_metrics.record

    def recorded(method: str, code: grpc.StatusCode, elapsed_s: float) -> None:
        record(method, code, elapsed_s)
        finished.put_nowait((method, code))

    # The interceptor records an RPC after its handler has ended (a commit and a discard
    # included), also when the cancel landed before the handler began.
    monkeypatch.setattr(handle.rpc_metrics, "record", recorded)
    try:
        await handle.start()
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = cache_pb2_grpc.CacheStub(channel)
            call = stub.Store(timeout=TIMEOUT_S)
            for message in store_messages():  # the finish too, but the stream is never half-closed
                await call.write(message)
            await call.initial_metadata()  # the service has taken the call
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # Only once the service has finished the call is "nothing stored" a finding.
            assert await asyncio.wait_for(finished.get(), TIMEOUT_S) == ("/aiserve.v1.Cache/Store",
                                                                          grpc.StatusCode.CANCELLED)
            assert not (await lookup(stub, Q)).hit
            assert (await stub.Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)).entries == 0
        for outcome in ("stored", "refused"):  # "abandoned" if the handler had begun
            assert handle.registry.get_sample_value("aiserve_cache_stores_total", {"outcome": outcome}) is None
    finally:
        await handle.stop(0)


async def test_a_store_cancelled_while_it_commits_keeps_nothing(tmp_path: Path, embedder: Embedder) -> None:
    """grpc ends a cancelled call's request stream like a half-close and cancels the handler
    afterwards, so the cancel can land while the answer is being committed: it must not stay."""
    config = config_for(tmp_path)
    metrics = HeldReplacement()
    cache = open_semantic_cache(config, embedder.model_id, embedder.dim, metrics.count_removal)
    registry = CollectorRegistry()
    metrics.register(registry, cache)
    servicer = CacheServicer(cache, embedder, config, metrics)

    async def requests() -> AsyncIterator[cache_pb2.StoreRequest]:
        for message in store_messages():
            yield message

    try:
        scope = CacheScope(SCOPE_PB.model, SCOPE_PB.tenant, SCOPE_PB.params)
        cache.store(scope, f"<user>{Q}", "An older answer.", (3,), "stop")  # the commit below replaces it
        handler = asyncio.create_task(servicer.Store(requests(), None))  # type: ignore[arg-type]
        await asyncio.wait_for(metrics.replacing.wait(), TIMEOUT_S)  # held inside its transaction
        handler.cancel()
        metrics.release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(handler, TIMEOUT_S)
        # A lookup takes the cache's lock, so it sees the cache after the commit thread is done.
        assert await asyncio.to_thread(cache.lookup, scope, f"<user>{Q}") is None
        assert cache.num_entries == cache.num_vectors == 0
        assert registry.get_sample_value("aiserve_cache_stores_total", {"outcome": "abandoned"}) == 1
        assert registry.get_sample_value("aiserve_cache_evictions_total", {"reason": "abandoned"}) is None
    finally:
        metrics.release.set()
        cache.close()


async def test_empty_prompt_is_invalid_argument(stub: cache_pb2_grpc.CacheStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE_PB, prompt=""), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()


async def test_invalidate_feedback_and_info(stub: cache_pb2_grpc.CacheStub) -> None:
    first = await store(stub, store_messages())
    second = await store(stub, store_messages("How many legs does a spider have?", [("Eight.", [9])]))
    info = await stub.Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)
    assert info.entries == 2 and info.similarity_threshold == pytest.approx(DEFAULT_SIMILARITY_THRESHOLD)
    assert info.key_term_guard and info.index_kind == "flat" and not info.shared_across_tenants
    assert info.embedding_model.startswith("all-MiniLM-L6-v2@")
    chosen, why = choose_dtype("cpu", read_cpu_flags(), "auto")  # the service's embedder chose for this CPU
    assert (info.embedding_dtype, info.embedding_dtype_reason) == (chosen, why)

    feedback = await stub.ReportFeedback(cache_pb2.CacheFeedbackRequest(entry_id=first, negative=True,
                                                                        similarity=0.93), timeout=TIMEOUT_S)
    assert feedback.found and feedback.removed
    assert not (await lookup(stub, "Which city is the capital of France?")).hit
    gone = await stub.ReportFeedback(cache_pb2.CacheFeedbackRequest(entry_id=first, negative=True), timeout=TIMEOUT_S)
    assert not gone.found

    removed = await stub.Invalidate(cache_pb2.InvalidateRequest(entry_id=second), timeout=TIMEOUT_S)
    assert removed.removed == 1
    with pytest.raises(grpc.RpcError) as err:
        await stub.Invalidate(cache_pb2.InvalidateRequest(), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_info_reports_the_settings_it_serves_with(tmp_path: Path, embedder: Embedder) -> None:
    config = config_for(tmp_path, similarity_threshold=0.93, key_term_guard=False, index_kind="hnsw",
                        shared_across_tenants=True)
    handle = await create_server(config, embedder)
    try:
        await handle.start()
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            info = await cache_pb2_grpc.CacheStub(channel).Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)
        assert info.similarity_threshold == pytest.approx(0.93) and not info.key_term_guard
        assert info.index_kind == "hnsw" and info.shared_across_tenants
    finally:
        await handle.stop(0)


async def test_entries_and_index_survive_a_restart_even_without_the_index_file(
    tmp_path: Path, embedder: Embedder
) -> None:
    config = config_for(tmp_path)
    for round_ in range(3):
        if round_ == 2:
            config.resolved_index_path().unlink()  # rebuilt from SQLite, the record
        handle = await create_server(config, embedder)
        try:
            await handle.start()
            async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = cache_pb2_grpc.CacheStub(channel)
                if round_ == 0:
                    await store(stub, store_messages(finish=common_pb2.FINISH_REASON_LENGTH))
                else:
                    reply = await lookup(stub, "Which city is the capital of France?")
                    assert reply.hit and reply.tier == cache_pb2.MATCH_TIER_SEMANTIC
                    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            await handle.stop(0)
        assert config.resolved_index_path().is_file()
