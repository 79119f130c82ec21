"""The gateway's side of the cache (DESIGN.md §2, steps 3 and 6): a request's namespace and
query, the lookup, and the streaming store.

The cache is an optimisation: when it fails, a lookup is a miss and a store is dropped, and the
request is served all the same (with a warning in the log).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from aiserve.common.errors import InvalidArgument
from aiserve.common.logging import get_logger
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2

log = get_logger("cache_client")

LOOKUP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Where a request's answer is looked up and stored."""

    scope: cache_pb2.CacheScope
    prompt: str
    """The rendered prompt: the exact tier's key."""
    query: str
    """What the semantic tier compares (the last user message); "" = exact tier only."""


def cache_key(model: str, tenant: str, params: str, rendered: str,
              messages: Sequence[tuple[str, str]] | None, is_truncated: bool) -> CacheKey:
    """The namespace is model, tenant, decoding parameters and the conversation before the last
    user message (system prompt, earlier turns; as a sha256, the cache only compares it). Only a
    chat's last user message is matched by meaning: a raw prompt is text to continue, where the
    wording is the content, and a truncated prompt is not what the user wrote."""
    query, context = "", ""
    if messages and not is_truncated and messages[-1][0] == "user":
        query = messages[-1][1]
        earlier = json.dumps([list(m) for m in messages[:-1]], ensure_ascii=False, separators=(",", ":"))
        context = hashlib.sha256(earlier.encode("utf-8")).hexdigest()
    scope = cache_pb2.CacheScope(model=model, tenant=tenant, params=params, context=context)
    return CacheKey(scope, rendered, query)


async def lookup(stub: cache_pb2_grpc.CacheStub, key: CacheKey,
                 min_similarity: float | None) -> cache_pb2.LookupResponse | None:
    """The cached answer, or None (a miss, or the cache failed)."""
    request = cache_pb2.LookupRequest(scope=key.scope, prompt=key.prompt, query=key.query)
    if min_similarity is not None:
        request.min_similarity = min_similarity
    try:
        reply = await stub.Lookup(request, timeout=LOOKUP_TIMEOUT_S)
    except grpc.RpcError as exc:
        log.warning("cache_lookup_failed", code=exc.code().name)  # type: ignore[attr-defined]
        return None
    return reply if reply.hit else None


def replay(reply: cache_pb2.LookupResponse) -> list[tuple[str, tuple[int, ...]]]:
    """A hit as the stream it was: (text, token ids) per original delta."""
    if not reply.deltas:
        return [(reply.text, tuple(reply.token_ids))]
    return [(d.text, tuple(d.token_ids)) for d in reply.deltas]


class StoreStream:
    """A generation streamed into the cache as it is produced (a client-streaming Store).

    ``add`` never waits on the cache (a queue feeds the call), so a slow or dead cache never
    slows the client's stream. ``commit`` sends the finish and closes the stream, which is when
    the cache stores the entry; ``abort`` cancels the call, and the cache keeps nothing.
    """

    def __init__(self, stub: cache_pb2_grpc.CacheStub, key: CacheKey, timeout_s: float) -> None:
        self._queue: asyncio.Queue[cache_pb2.StoreRequest | None] = asyncio.Queue()
        header = cache_pb2.StoreHeader(scope=key.scope, prompt=key.prompt, query=key.query)
        self._queue.put_nowait(cache_pb2.StoreRequest(header=header))
        self._call = stub.Store(self._requests(), timeout=timeout_s)
        self._is_closed = False

    async def _requests(self) -> AsyncIterator[cache_pb2.StoreRequest]:
        while (message := await self._queue.get()) is not None:
            yield message

    def add(self, text: str, token_ids: Sequence[int]) -> None:
        """One delta, exactly as the client received it."""
        if not self._is_closed:
            self._queue.put_nowait(cache_pb2.StoreRequest(delta=cache_pb2.AnswerDelta(text=text, token_ids=token_ids)))

    async def commit(self, finish_reason: common_pb2.FinishReason) -> str:
        """Finish and close the stream; returns the entry id ("" when the cache refused or failed).
        Shielded: a client leaving right after the last message does not lose a finished answer."""
        if self._is_closed:
            return ""
        self._is_closed = True
        self._queue.put_nowait(cache_pb2.StoreRequest(finish=cache_pb2.StoreFinish(finish_reason=finish_reason)))
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


def checked_min_similarity(value: float | None) -> float | None:
    """GenerateRequest.cache_min_similarity, validated: [0, 1] or unset."""
    if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
        raise InvalidArgument(f"cache_min_similarity: must be in [0, 1], got {value}")
    return value
