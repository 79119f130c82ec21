"""The cache service: a thin gRPC servicer over SemanticCache (docs/cache.md).

The cache never calls other services. Each RPC converts pb -> domain, embeds the query on the
service's one embedding thread (the model blocks; its own executor, so embeddings queue there
and never hold up the SQLite and faiss calls, which run in asyncio's worker threads), calls
SemanticCache in a worker thread and converts back; the conversions live in this file only. The
embedding model is loaded and run once before the server is handed back, so the service
reports SERVING warm.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor

import faiss
from grpc import aio

from aiserve.common.errors import InvalidArgument
from aiserve.common.finish import STORABLE, FinishReason
from aiserve.common.logging import get_logger, log_startup
from aiserve.common.pb_enums import finish_reason_from_pb, finish_reason_to_pb
from aiserve.common.server import ServiceHandle, new_server, run_service
from aiserve.v1 import cache_pb2, cache_pb2_grpc
from services.cache.config import CacheConfig
from services.cache.embedder import Embedder, Vector
from services.cache.entry import CacheEntry, CacheScope
from services.cache.metrics import CacheMetrics
from services.cache.record import RemovalHook
from services.cache.record_schema import entry_bytes
from services.cache.semantic import Hit, SemanticCache

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
_TIERS = {"exact": cache_pb2.MATCH_TIER_EXACT, "semantic": cache_pb2.MATCH_TIER_SEMANTIC}

log = get_logger("cache")


# --- pb <-> domain, in one place -----------------------------------------------------------

def scope_from_pb(scope: cache_pb2.CacheScope) -> CacheScope:
    return CacheScope(model=scope.model, tenant=scope.tenant, params=scope.params, context=scope.context)


def hit_to_pb(hit: Hit) -> cache_pb2.LookupResponse:
    entry, reply = hit.entry, cache_pb2.LookupResponse(hit=True)
    reply.text, reply.entry_id, reply.similarity = entry.text, entry.entry_id, hit.similarity
    reply.token_ids.extend(entry.token_ids)
    reply.finish_reason, reply.tier = finish_reason_to_pb(FinishReason(entry.finish_reason)), _TIERS[hit.tier]
    chars = tokens = 0
    for num_chars, num_tokens in entry.deltas:
        reply.deltas.add(text=entry.text[chars:chars + num_chars],
                         token_ids=entry.token_ids[tokens:tokens + num_tokens])
        chars, tokens = chars + num_chars, tokens + num_tokens
    return reply


class _EndedEarly(InvalidArgument):
    """A Store stream ended before its finish: the generation did not finish, or the client
    cancelled (grpc ends a cancelled call's request stream the same way). Nothing is stored, and
    no input was bad: counted as "abandoned", not "refused"."""


class _StoreStream:
    """What a Store stream has sent so far; checks order and size as messages arrive. The query
    is embedded (``embed``) while the generation is still streaming in."""

    def __init__(self, header: cache_pb2.StoreHeader, max_entry_bytes: int,
                 embed: Callable[[str], Coroutine[None, None, Vector | None]]) -> None:
        self.scope, self.prompt, self.query = scope_from_pb(header.scope), header.prompt, header.query
        self.ttl_s, self.max_entry_bytes = header.ttl_s, max_entry_bytes
        if not self.scope.model or not self.prompt:
            raise InvalidArgument("header: scope.model and prompt are required")
        self.embedding: asyncio.Task[Vector | None] = asyncio.create_task(embed(self.query))
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.deltas: list[tuple[int, int]] = []
        self.num_bytes = entry_bytes(self.prompt, self.query, "", 0, 0)
        self.finish: FinishReason | None = None

    def add(self, message: cache_pb2.StoreRequest) -> None:
        part = message.WhichOneof("part")
        if self.finish is not None:
            raise InvalidArgument("finish: must be the last message of a Store stream")
        if part == "delta":
            text, ids = message.delta.text, message.delta.token_ids
            self.texts.append(text)
            self.token_ids.extend(ids)
            self.deltas.append((len(text), len(ids)))
            self.num_bytes += entry_bytes("", "", text, len(ids), 1)
            if self.num_bytes > self.max_entry_bytes:
                raise InvalidArgument(f"entry: over max_entry_bytes {self.max_entry_bytes}; nothing stored")
        elif part == "finish":
            finish = finish_reason_from_pb(message.finish.finish_reason)
            if finish not in STORABLE:
                raise InvalidArgument(f"finish_reason: only stop/length answers are stored, "
                                      f"got {finish.value if finish else 'none'!r}")
            self.finish = finish
        else:
            raise InvalidArgument(f"{part or 'part'}: only the first message of a Store stream is a header")


# --- the servicer ---------------------------------------------------------------------------

class CacheServicer(cache_pb2_grpc.CacheServicer):
    """Lookup, Store, Invalidate, ReportFeedback and Info over one SemanticCache."""

    def __init__(self, cache: SemanticCache, embedder: Embedder, config: CacheConfig, metrics: CacheMetrics) -> None:
        self._cache, self._embedder, self._config, self._metrics = cache, embedder, config, metrics
        self._vectors: OrderedDict[str, Vector | None] = OrderedDict()  # recent query -> vector
        self._embedding: dict[str, asyncio.Future[Vector | None]] = {}  # query -> its embedding in progress
        # One thread: the model runs one forward pass at a time anyway (on embedding_threads torch
        # threads), and waiting embeddings queue here instead of filling asyncio's worker threads,
        # which the exact tier's SQLite reads need at once.
        self._embedder_thread = ThreadPoolExecutor(1, thread_name_prefix="cache-embed")

    def close(self) -> None:
        """Stop the embedding thread (after the server stopped)."""
        self._embedder_thread.shutdown(wait=False, cancel_futures=True)

    async def _vector(self, query: str) -> Vector | None:
        """The query's embedding: remembered, in progress (a Store and the Lookup before it share
        one), or computed now on the embedding thread."""
        if not query:
            return None
        if query in self._vectors:
            self._vectors.move_to_end(query)
            return self._vectors[query]
        if (pending := self._embedding.get(query)) is None:
            pending = asyncio.get_running_loop().run_in_executor(
                self._embedder_thread, self._embedder.encode_one, query)
            self._embedding[query] = pending
            pending.add_done_callback(lambda done: self._embedded(query, done))
        return await asyncio.shield(pending)  # a caller that leaves does not cancel it for the others

    def _embedded(self, query: str, done: asyncio.Future[Vector | None]) -> None:
        del self._embedding[query]
        if done.cancelled() or done.exception() is not None or not self._config.query_cache_size:
            return
        self._vectors[query] = done.result()
        while len(self._vectors) > self._config.query_cache_size:
            self._vectors.popitem(last=False)

    async def Lookup(  # noqa: N802 - gRPC method name
        self, request: cache_pb2.LookupRequest, context: aio.ServicerContext
    ) -> cache_pb2.LookupResponse:
        """The stored answer for this scope and prompt or query; a miss is ``hit=false``."""
        started = time.perf_counter()
        if self._config.lookup_delay_ms:  # a test setting: a slow cache on purpose
            await asyncio.sleep(self._config.lookup_delay_ms / 1000)
        scope = scope_from_pb(request.scope)
        min_similarity = request.min_similarity if request.HasField("min_similarity") else None
        # The exact tier first: an exact hit needs no embedding.
        hit = await asyncio.to_thread(self._cache.lookup, scope, request.prompt, "", None, min_similarity)
        if hit is None and request.query and (vector := await self._vector(request.query)) is not None:
            hit = await asyncio.to_thread(self._cache.lookup, scope, request.prompt, request.query, vector,
                                          min_similarity)
        self._metrics.count_lookup(None if hit is None else hit.tier, 0.0 if hit is None else hit.similarity,
                                   time.perf_counter() - started, "both" if request.query else "exact")
        return cache_pb2.LookupResponse(hit=False) if hit is None else hit_to_pb(hit)

    async def Store(  # noqa: N802
        self, request_iterator: AsyncIterator[cache_pb2.StoreRequest], context: aio.ServicerContext
    ) -> cache_pb2.StoreResponse:
        """Collect a streamed answer; commit it only after a storable finish and the end of the stream."""
        stream: _StoreStream | None = None
        outcome = "abandoned"
        try:
            async for message in request_iterator:
                if stream is None:
                    if message.WhichOneof("part") != "header":
                        raise InvalidArgument("header: the first message of a Store stream must be a header")
                    stream = _StoreStream(message.header, self._config.record.max_entry_bytes, self._vector)
                else:
                    stream.add(message)
            if stream is None or stream.finish is None:
                raise _EndedEarly("finish: the stream ended before the generation finished; nothing stored")
            entry = await self._commit(stream, stream.finish)
            outcome = "stored"
            return cache_pb2.StoreResponse(entry_id=entry.entry_id)
        except InvalidArgument as exc:
            outcome = "abandoned" if isinstance(exc, _EndedEarly) else "refused"
            # Read the rest of the stream first (and drop it): answered while the client still
            # writes, the status races its next write, and the client may see that write fail
            # (INTERNAL "Internal error from Core") instead of the field that was refused.
            async for _ in request_iterator:
                pass
            raise
        finally:
            self._metrics.count_store(outcome)
            if stream is not None and not stream.embedding.done():
                stream.embedding.cancel()

    async def _commit(self, stream: _StoreStream, finish: FinishReason) -> CacheEntry:
        """Store a finished answer (in a worker thread: SQLite and faiss block).

        grpc ends the request stream of a call the client cancelled as if the client had
        half-closed it, and cancels this handler only afterwards; so a cancel that lands while
        the commit runs waits for the commit and discards its entry: a cancelled Store keeps
        nothing, whether or not its finish had arrived.
        """
        vector = await stream.embedding
        commit = asyncio.ensure_future(asyncio.to_thread(
            self._cache.store, stream.scope, stream.prompt, "".join(stream.texts), stream.token_ids, finish,
            query=stream.query, vector=vector, deltas=stream.deltas, ttl_s=stream.ttl_s or None))
        try:
            return await asyncio.shield(commit)
        except asyncio.CancelledError:
            entry = await commit
            await asyncio.to_thread(self._cache.discard, entry.entry_id)
            log.info("cache_store_discarded", entry_id=entry.entry_id, reason="cancelled while committing")
            raise

    async def Invalidate(  # noqa: N802
        self, request: cache_pb2.InvalidateRequest, context: aio.ServicerContext
    ) -> cache_pb2.InvalidateResponse:
        """Remove the entries of one model, namespace, tenant or entry."""
        target = request.WhichOneof("target")
        scope = scope_from_pb(request.scope) if target == "scope" else None
        if target is None or (scope is not None and not scope.model) or not (scope or getattr(request, target)):
            raise InvalidArgument("target: set one of model, scope (with its model), tenant or entry_id")
        removed = await asyncio.to_thread(self._cache.invalidate, model=request.model, scope=scope,
                                          tenant=request.tenant, entry_id=request.entry_id)
        log.info("cache_invalidated", target=target, removed=removed)
        return cache_pb2.InvalidateResponse(removed=removed)

    async def ReportFeedback(  # noqa: N802
        self, request: cache_pb2.CacheFeedbackRequest, context: aio.ServicerContext
    ) -> cache_pb2.CacheFeedbackResponse:
        """Count feedback on a served entry; enough negative reports remove the entry."""
        if not request.entry_id:
            raise InvalidArgument("entry_id: required (LookupResponse.entry_id of the hit)")
        if not 0.0 <= request.similarity <= 1.0:
            raise InvalidArgument(f"similarity: must be in [0, 1], got {request.similarity}")
        self._metrics.count_feedback(request.negative, request.similarity)
        found, removed = await asyncio.to_thread(self._cache.feedback, request.entry_id, request.negative)
        log.info("cache_feedback", entry_id=request.entry_id, negative=request.negative, removed=removed)
        return cache_pb2.CacheFeedbackResponse(found=found, removed=removed)

    async def Info(  # noqa: N802
        self, request: cache_pb2.CacheInfoRequest, context: aio.ServicerContext
    ) -> cache_pb2.CacheInfoResponse:
        """What this cache serves with."""
        rule = self._cache.rule
        return cache_pb2.CacheInfoResponse(
            embedding_model=self._embedder.model_id, similarity_threshold=rule.similarity_threshold,
            key_term_guard=rule.key_term_guard, index_kind=self._config.index.index_kind,
            entries=self._cache.num_entries, shared_across_tenants=self._config.record.shared_across_tenants,
            embedding_dtype=self._embedder.dtype, embedding_dtype_reason=self._embedder.dtype_reason)


def open_semantic_cache(config: CacheConfig, embedder_id: str, dim: int, on_remove: RemovalHook) -> SemanticCache:
    """The SemanticCache ``config`` describes (blocking: opens SQLite, loads or rebuilds the index)."""
    return SemanticCache(config.resolved_db_path(), config.resolved_index_path(), dim=dim, record=config.record,
                         rule=config.match_rule, index=config.index, embedder_id=embedder_id, on_remove=on_remove)


async def create_server(
    config: CacheConfig, embedder: Embedder | None = None, metrics: CacheMetrics | None = None
) -> ServiceHandle:
    """Load and warm the embedding model (unless given), open the cache, build the (not yet
    started) server with its metrics in its own registry; the handle's close snapshots the
    index and closes the file. ``embedder`` and ``metrics`` are given by tests."""
    faiss.omp_set_num_threads(config.index_threads)
    if embedder is None:
        embedder = await asyncio.to_thread(Embedder, config.embedding_device, config.embedding_threads,
                                           config.embedding_dtype)
    log_startup("loaded")
    await asyncio.to_thread(embedder.encode_one, "warm-up")  # first forward pass allocates
    log_startup("warmed")
    metrics = CacheMetrics() if metrics is None else metrics
    cache = await asyncio.to_thread(open_semantic_cache, config, embedder.model_id, embedder.dim,
                                    metrics.count_removal)
    try:
        handle = new_server("cache", [SERVICE_NAME], config.host, config.port)
    except BaseException:
        await asyncio.to_thread(cache.close)
        raise
    servicer = CacheServicer(cache, embedder, config, metrics)
    cache_pb2_grpc.add_CacheServicer_to_server(servicer, handle.server)
    handle.servicer = servicer
    metrics.register(handle.registry, cache)

    async def close() -> None:
        servicer.close()
        await asyncio.to_thread(cache.close)

    handle.on_close.append(close)
    log.info("cache_opened", path=str(config.resolved_db_path()), entries=cache.num_entries,
             index=cache.index_source, embedding_model=embedder.model_id, embedding_dtype=embedder.dtype,
             embedding_dtype_reason=embedder.dtype_reason, embedding_packed=embedder.packed,
             threshold=config.match_rule.similarity_threshold)
    return handle


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m services.cache``."""
    run_service("cache", CacheConfig, create_server, argv)
