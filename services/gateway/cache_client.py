"""The cache service as the pipeline needs it: look up an answer, stream one into the cache,
report feedback on one it served.

The edge: the ``AnswerCache`` of ``services/gateway/interfaces.py`` over gRPC (the key's rules
are ``cache_keys.py``). The cache is an optimisation: when it fails, a lookup is a miss and a
store is dropped, and the request is served all the same (with a warning in the log).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from aiserve.common.finish import FinishReason
from aiserve.common.logging import get_logger
from aiserve.common.pb_enums import finish_reason_from_pb, finish_reason_to_pb
from aiserve.v1 import cache_pb2, cache_pb2_grpc
from services.gateway.domain import CachedAnswer, CacheKey, CacheScope, Chunk

log = get_logger("cache_client")

LOOKUP_TIMEOUT_S = 5.0
FEEDBACK_TIMEOUT_S = 5.0


def scope_to_pb(scope: CacheScope) -> cache_pb2.CacheScope:
    return cache_pb2.CacheScope(model=scope.model, tenant=scope.tenant, params=scope.params, context=scope.context)


def answer_from_pb(reply: cache_pb2.LookupResponse) -> CachedAnswer:
    """A hit as the stream it was: a chunk per original delta (a single one when the entry has
    no deltas). An entry's finish reason is always storable; an unknown one reads as STOP."""
    deltas = tuple(Chunk(d.text, tuple(d.token_ids)) for d in reply.deltas) or (
        Chunk(reply.text, tuple(reply.token_ids)),)
    return CachedAnswer(
        deltas=deltas, completion_tokens=len(reply.token_ids),
        finish_reason=finish_reason_from_pb(reply.finish_reason) or FinishReason.STOP,
        similarity=reply.similarity, entry_id=reply.entry_id,
    )


class CacheClient:
    """Lookups, stores and feedback on the cache service."""

    def __init__(self, stub: cache_pb2_grpc.CacheStub) -> None:
        self._stub = stub

    async def lookup(self, key: CacheKey, min_similarity: float | None) -> CachedAnswer | None:
        """The cached answer, or None (a miss, or the cache failed)."""
        request = cache_pb2.LookupRequest(scope=scope_to_pb(key.scope), prompt=key.prompt, query=key.query)
        if min_similarity is not None:
            request.min_similarity = min_similarity
        try:
            reply = await self._stub.Lookup(request, timeout=LOOKUP_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("cache_lookup_failed", code=exc.code().name)  # type: ignore[attr-defined]
            return None
        return answer_from_pb(reply) if reply.hit else None

    def open_store(self, key: CacheKey, timeout_s: float) -> StoreStream:
        """Start streaming an answer for ``key`` into the cache."""
        return StoreStream(self._stub, key, timeout_s)

    async def report_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        """Tell the cache how an answer it served was rated (it may evict the entry). Best
        effort: the rating is already in the ledger, so a cache failure is only logged."""
        request = cache_pb2.CacheFeedbackRequest(entry_id=entry_id, negative=is_negative, similarity=similarity)
        try:
            await self._stub.ReportFeedback(request, timeout=FEEDBACK_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("cache_feedback_failed", code=exc.code().name)  # type: ignore[attr-defined]


class StoreStream:
    """A generation streamed into the cache as it is produced (a client-streaming Store).

    ``add`` never waits on the cache (a queue feeds the call), so a slow or dead cache never
    slows the client's stream. ``commit`` sends the finish and closes the stream, which is when
    the cache stores the entry; ``abort`` cancels the call, and the cache keeps nothing.
    """

    def __init__(self, stub: cache_pb2_grpc.CacheStub, key: CacheKey, timeout_s: float) -> None:
        self._queue: asyncio.Queue[cache_pb2.StoreRequest | None] = asyncio.Queue()
        header = cache_pb2.StoreHeader(scope=scope_to_pb(key.scope), prompt=key.prompt, query=key.query)
        self._queue.put_nowait(cache_pb2.StoreRequest(header=header))
        self._call = stub.Store(self._requests(), timeout=timeout_s)
        self._is_closed = False

    async def _requests(self) -> AsyncIterator[cache_pb2.StoreRequest]:
        while (message := await self._queue.get()) is not None:
            yield message

    def add(self, chunk: Chunk) -> None:
        """One delta, exactly as the client received it."""
        if not self._is_closed:
            delta = cache_pb2.AnswerDelta(text=chunk.text_delta, token_ids=chunk.token_ids)
            self._queue.put_nowait(cache_pb2.StoreRequest(delta=delta))

    async def commit(self, finish_reason: FinishReason) -> str:
        """Finish and close the stream; returns the entry id ("" when the cache refused or failed).
        Shielded: a client leaving right after the last message does not lose a finished answer."""
        if self._is_closed:
            return ""
        self._is_closed = True
        finish = cache_pb2.StoreFinish(finish_reason=finish_reason_to_pb(finish_reason))
        self._queue.put_nowait(cache_pb2.StoreRequest(finish=finish))
        self._queue.put_nowait(None)
        try:
            reply = await asyncio.shield(self._call)  # type: ignore[arg-type]
        except grpc.RpcError as exc:
            log.warning("cache_store_failed", code=exc.code().name, details=exc.details())  # type: ignore[attr-defined]
            return ""
        return str(reply.entry_id)

    def abort(self) -> None:
        """Drop the answer: a cancelled or failed generation leaves nothing in the cache."""
        if not self._is_closed:
            self._is_closed = True
            self._call.cancel()
