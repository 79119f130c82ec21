"""Where the cache service embeds: on one thread of its own, with one torch thread, never in the
event loop or in the worker threads the exact tier needs; one embedding per query in flight;
and the test setting that makes lookups slow. Real gRPC, the real model, real SQLite and faiss."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch
from grpc import aio

from aiserve.common.server import ServiceHandle
from aiserve.v1 import cache_pb2, cache_pb2_grpc
from services.cache.embedder import Embedder, Vector
from services.cache.server import CacheServicer, create_server
from tests.unit.cache.support import SCOPE_PB, TIMEOUT_S, Q, config_for, lookup, store, store_messages


class HeldEmbedder(Embedder):
    """The real model, whose forward passes wait while the test holds them; records on which
    thread, with how many torch threads, and for which texts it ran."""

    def __init__(self, inner: Embedder) -> None:  # no super().__init__: the model is ``inner``'s
        self._inner = inner
        self.model_id, self.dim, self.max_tokens = inner.model_id, inner.dim, inner.max_tokens
        self.dtype, self.dtype_reason, self.packed = inner.dtype, inner.dtype_reason, inner.packed
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.calls: list[tuple[str, str, int]] = []
        """(text, thread name, torch threads) of every call."""

    def encode(self, texts: Sequence[str]) -> list[Vector | None]:
        self.calls.extend((t, threading.current_thread().name, torch.get_num_threads()) for t in texts)
        self.entered.set()
        assert self.open.wait(TIMEOUT_S), "the test never let the embedding go on"
        return self._inner.encode(texts)


@pytest.fixture
async def held(embedder: Embedder) -> HeldEmbedder:
    return HeldEmbedder(embedder)


@pytest.fixture
async def handle(tmp_path: Path, held: HeldEmbedder) -> AsyncIterator[ServiceHandle]:
    handle = await create_server(config_for(tmp_path), held)
    try:
        await handle.start()
        yield handle
    finally:
        held.open.set()
        await handle.stop(0)


@pytest.fixture
async def stub(handle: ServiceHandle) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        yield cache_pb2_grpc.CacheStub(channel)


async def test_embeddings_wait_on_their_own_thread_while_the_exact_tier_answers(
    stub: cache_pb2_grpc.CacheStub, held: HeldEmbedder
) -> None:
    await store(stub, store_messages())
    held.open.clear()
    held.entered.clear()
    # More lookups that need an embedding than asyncio has worker threads on this machine.
    slow = [asyncio.create_task(lookup(stub, f"Question number {i} about the sea?")) for i in range(12)]
    assert await asyncio.to_thread(held.entered.wait, TIMEOUT_S)
    exact = cache_pb2.LookupRequest(scope=SCOPE_PB, prompt=f"<user>{Q}")  # no query: the exact tier only
    for _ in range(3):  # (well before the held embeddings would give up)
        reply = await stub.Lookup(exact, timeout=TIMEOUT_S / 4)
        assert reply.hit and reply.tier == cache_pb2.MATCH_TIER_EXACT
    info = await stub.Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S / 4)
    assert info.entries == 1
    assert not any(task.done() for task in slow)  # the embeddings are still held
    held.open.set()
    assert not any(reply.hit for reply in await asyncio.wait_for(asyncio.gather(*slow), TIMEOUT_S))
    asked = [call for call in held.calls if call[0].startswith("Question number")]
    assert len(asked) == 12
    assert {(name.split("_")[0], threads) for _, name, threads in asked} == {("cache-embed", 1)}


async def test_one_embedding_per_query_in_flight(tmp_path: Path, held: HeldEmbedder) -> None:
    """A Store and the Lookup before it (the gateway sends both while the lookup runs) share
    one embedding, even with no remembered vectors."""
    handle = await create_server(config_for(tmp_path, query_cache_size=0), held)
    servicer = handle.servicer
    assert isinstance(servicer, CacheServicer)
    query = "Which river flows through Vienna?"
    try:
        held.open.clear()
        held.entered.clear()
        first = asyncio.create_task(servicer._vector(query))
        second = asyncio.create_task(servicer._vector(query))
        assert await asyncio.to_thread(held.entered.wait, TIMEOUT_S)  # both have asked by now
        held.open.set()
        one, two = await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT_S)
        assert one is two and [text for text, _, _ in held.calls].count(query) == 1
        second_time = await asyncio.wait_for(servicer._vector(query), TIMEOUT_S)  # nothing remembered
        assert second_time is not one and [text for text, _, _ in held.calls].count(query) == 2
    finally:
        held.open.set()
        await handle.stop(0)


async def test_the_lookup_delay_test_setting_slows_lookups_but_nothing_else(
    tmp_path: Path, embedder: Embedder
) -> None:
    handle = await create_server(config_for(tmp_path, lookup_delay_ms=300), embedder)
    try:
        await handle.start()
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = cache_pb2_grpc.CacheStub(channel)
            started = time.monotonic()
            looking = asyncio.create_task(lookup(stub, Q))
            await stub.Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)  # answered meanwhile
            assert not looking.done()
            assert not (await asyncio.wait_for(looking, TIMEOUT_S)).hit
            assert time.monotonic() - started >= 0.3
    finally:
        await handle.stop(0)
