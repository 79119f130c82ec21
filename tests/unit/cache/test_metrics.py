"""Each cache server counts into its own registry: two servers in one process (port 0) never
share or rebind a metric."""

from __future__ import annotations

from pathlib import Path

from grpc import aio

from aiserve.common.server import ServiceHandle
from aiserve.v1 import cache_pb2, cache_pb2_grpc
from services.cache.embedder import Embedder
from services.cache.server import create_server
from tests.unit.cache.support import SCOPE_PB, TIMEOUT_S, config_for, lookup, store, store_messages


async def test_two_cache_servers_in_one_process_each_report_their_own_metrics(
    tmp_path: Path, embedder: Embedder
) -> None:
    first = await create_server(config_for(tmp_path / "first"), embedder)
    try:
        second = await create_server(config_for(tmp_path / "second"), embedder)
        try:
            await first.start()
            await second.start()
            async with aio.insecure_channel(f"127.0.0.1:{first.port}") as one, \
                    aio.insecure_channel(f"127.0.0.1:{second.port}") as two:
                stub_one, stub_two = cache_pb2_grpc.CacheStub(one), cache_pb2_grpc.CacheStub(two)
                await store(stub_one, store_messages())
                for query in ("How many legs does a spider have?", "What is 12 times 7?"):
                    await store(stub_two, store_messages(query))
                assert (await lookup(stub_one, "Which city is the capital of France?")).hit
                removed = await stub_two.Invalidate(cache_pb2.InvalidateRequest(model=SCOPE_PB.model),
                                                    timeout=TIMEOUT_S)
                assert removed.removed == 2

            def sample(handle: ServiceHandle, name: str, **labels: str) -> float | None:
                return handle.registry.get_sample_value(name, labels)

            # Entries and vectors: what each server's own cache holds, read when scraped.
            assert sample(first, "aiserve_cache_entries") == 1 and sample(first, "aiserve_cache_vectors") == 1
            assert sample(second, "aiserve_cache_entries") == 0 and sample(second, "aiserve_cache_vectors") == 0
            # Counters: what each server did, and nothing the other did.
            assert sample(first, "aiserve_cache_stores_total", outcome="stored") == 1
            assert sample(second, "aiserve_cache_stores_total", outcome="stored") == 2
            assert sample(first, "aiserve_cache_lookups_total", result="hit", tier="semantic", asked="both") == 1
            assert sample(second, "aiserve_cache_lookups_total", result="hit", tier="semantic", asked="both") is None
            # The removal hook counts into the metrics of the server whose cache removed entries.
            assert sample(second, "aiserve_cache_evictions_total", reason="invalidate") == 2
            assert sample(first, "aiserve_cache_evictions_total", reason="invalidate") is None
        finally:
            await second.stop(0)
    finally:
        await first.stop(0)
