"""The gateway's cache adapter against a fake cache service over a real gRPC socket: a failing
cache is a miss and a dropped store, a store is kept only when committed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest_asyncio

from aiserve.common.finish import FinishReason
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.gateway.cache_client import CacheClient
from services.gateway.domain import CachedAnswer, CacheKey, CacheScope, Chunk
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
KEY = CacheKey(CacheScope("m@1", "acme", "p", "ctx"), "RENDERED", "capital of France?")


@dataclass
class Seen:
    lookups: list[cache_pb2.LookupRequest] = field(default_factory=list)
    stores: list[list[cache_pb2.StoreRequest]] = field(default_factory=list)
    header: asyncio.Event = field(default_factory=asyncio.Event)
    delta: asyncio.Event = field(default_factory=asyncio.Event)
    store_ended: asyncio.Event = field(default_factory=asyncio.Event)
    feedback: list[cache_pb2.CacheFeedbackRequest] = field(default_factory=list)


class FakeCache(cache_pb2_grpc.CacheServicer):
    """Hits for the prompt "RENDERED" (with deltas) and "FLAT" (without); fails on "BREAK"."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def Lookup(self, request, context):  # noqa: N802, ANN001, ANN201
        self.seen.lookups.append(request)
        if request.prompt == "BREAK":
            await context.abort(grpc.StatusCode.INTERNAL, "index broken")
        if request.prompt == "RENDERED":
            return cache_pb2.LookupResponse(
                hit=True, text="Paris.", token_ids=[1, 2], finish_reason=common_pb2.FINISH_REASON_STOP,
                similarity=0.9, entry_id="e-1", deltas=[cache_pb2.AnswerDelta(text="Par", token_ids=[1]),
                                                        cache_pb2.AnswerDelta(text="is.", token_ids=[2])])
        if request.prompt == "FLAT":
            return cache_pb2.LookupResponse(hit=True, text="Paris.", token_ids=[1, 2],
                                            finish_reason=common_pb2.FINISH_REASON_LENGTH, similarity=1.0,
                                            entry_id="e-2")
        return cache_pb2.LookupResponse(hit=False)

    async def Store(self, requests, context):  # noqa: N802, ANN001, ANN201
        received: list[cache_pb2.StoreRequest] = []
        self.seen.stores.append(received)
        try:
            async for request in requests:
                received.append(request)
                (self.seen.delta if request.WhichOneof("part") == "delta" else self.seen.header).set()
        finally:
            self.seen.store_ended.set()  # a cancelled call ends the request stream too
        if received[0].header.prompt == "REFUSE":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "entry too large")
        return cache_pb2.StoreResponse(entry_id="new-entry")

    async def ReportFeedback(self, request, context):  # noqa: N802, ANN001, ANN201
        self.seen.feedback.append(request)
        if not request.entry_id.startswith("e-"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such entry")
        return cache_pb2.CacheFeedbackResponse(found=True)


@pytest_asyncio.fixture
async def cache() -> AsyncIterator[tuple[CacheClient, Seen]]:
    seen = Seen()
    async with fake_backend(cache_pb2_grpc.add_CacheServicer_to_server, FakeCache(seen)) as channel:
        yield CacheClient(cache_pb2_grpc.CacheStub(channel)), seen


async def test_a_hit_is_the_answer_as_it_was_streamed(cache: tuple[CacheClient, Seen]) -> None:
    client, seen = cache
    hit = await asyncio.wait_for(client.lookup(KEY, 0.95), TIMEOUT_S)
    assert hit is not None
    assert hit == CachedAnswer((Chunk("Par", (1,)), Chunk("is.", (2,))), 2, FinishReason.STOP, hit.similarity, "e-1")
    assert abs(hit.similarity - 0.9) < 1e-6  # a float32 on the wire
    flat = await asyncio.wait_for(client.lookup(CacheKey(KEY.scope, "FLAT", ""), None), TIMEOUT_S)
    assert flat is not None and flat.deltas == (Chunk("Paris.", (1, 2)),) and flat.finish_reason == FinishReason.LENGTH
    first, second = seen.lookups
    scope = first.scope
    assert (scope.model, scope.tenant, scope.params, scope.context) == ("m@1", "acme", "p", "ctx")
    assert (first.prompt, first.query) == ("RENDERED", "capital of France?")
    assert first.HasField("min_similarity") and abs(first.min_similarity - 0.95) < 1e-6
    assert not second.HasField("min_similarity")  # unset: the cache's own threshold


async def test_a_miss_and_a_failed_lookup_are_both_none(cache: tuple[CacheClient, Seen]) -> None:
    client, seen = cache
    assert await asyncio.wait_for(client.lookup(CacheKey(KEY.scope, "UNSEEN", ""), None), TIMEOUT_S) is None
    assert await asyncio.wait_for(client.lookup(CacheKey(KEY.scope, "BREAK", ""), None), TIMEOUT_S) is None
    assert len(seen.lookups) == 2


async def test_a_committed_store_sends_header_deltas_and_finish(cache: tuple[CacheClient, Seen]) -> None:
    client, seen = cache
    store = client.open_store(KEY, TIMEOUT_S)
    store.add(Chunk("Par", (1,)))
    store.add(Chunk("is.", (2,)))
    assert await asyncio.wait_for(store.commit(FinishReason.STOP), TIMEOUT_S) == "new-entry"
    store.add(Chunk("late", (3,)))  # after commit: ignored
    store.abort()  # after commit: a no-op
    [messages] = seen.stores
    assert [m.WhichOneof("part") for m in messages] == ["header", "delta", "delta", "finish"]
    assert (messages[0].header.prompt, messages[0].header.query, messages[0].header.scope.tenant) == (
        "RENDERED", "capital of France?", "acme")
    assert [(m.delta.text, list(m.delta.token_ids)) for m in messages[1:3]] == [("Par", [1]), ("is.", [2])]
    assert messages[3].finish.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_an_aborted_store_ends_the_call_without_a_finish(cache: tuple[CacheClient, Seen]) -> None:
    """Without the finish the cache keeps nothing; and the call ends (nothing waits for more)."""
    client, seen = cache
    store = client.open_store(KEY, TIMEOUT_S)
    store.add(Chunk("Par", (1,)))
    await asyncio.wait_for(seen.delta.wait(), TIMEOUT_S)  # the call is open on the cache, the delta arrived
    store.abort()
    await asyncio.wait_for(seen.store_ended.wait(), TIMEOUT_S)
    assert await store.commit(FinishReason.STOP) == ""  # too late: nothing is sent any more
    assert [m.WhichOneof("part") for m in seen.stores[0]] == ["header", "delta"]


async def test_a_refused_store_commits_to_no_entry(cache: tuple[CacheClient, Seen]) -> None:
    client, _ = cache
    store = client.open_store(CacheKey(KEY.scope, "REFUSE", ""), TIMEOUT_S)
    store.add(Chunk("x", (1,)))
    assert await asyncio.wait_for(store.commit(FinishReason.STOP), TIMEOUT_S) == ""


async def test_feedback_is_reported_and_a_failure_is_only_logged(cache: tuple[CacheClient, Seen]) -> None:
    client, seen = cache
    await asyncio.wait_for(client.report_feedback("e-1", True, 0.5), TIMEOUT_S)
    await asyncio.wait_for(client.report_feedback("gone", False, 0.0), TIMEOUT_S)  # refused: no exception
    assert [(f.entry_id, f.negative, f.similarity) for f in seen.feedback] == [("e-1", True, 0.5), ("gone", False, 0.0)]
