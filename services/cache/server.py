"""The cache service: a thin gRPC servicer over the exact-match tier.

The cache never calls other services. Each RPC converts pb -> domain, calls ``ExactCache`` in
a worker thread (SQLite blocks) and converts back; the conversions live in this file only.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from grpc import aio
from prometheus_client import Counter, Gauge

from aiserve.common.config import load_config
from aiserve.common.logging import configure_logging, get_logger
from aiserve.common.server import ServiceHandle, new_server, serve, start_metrics
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.config import CacheConfig
from services.cache.exact import EXACT_SIMILARITY, CacheEntry, CacheScope, ExactCache

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
_FINISH_PREFIX = "FINISH_REASON_"

log = get_logger("cache")

LOOKUPS = Counter("aiserve_cache_lookups_total", "Cache lookups", ["result"])
HITS, MISSES = LOOKUPS.labels("hit"), LOOKUPS.labels("miss")
STORES = Counter("aiserve_cache_stores_total", "Answers stored in the cache")
EVICTIONS = Counter("aiserve_cache_evictions_total", "Entries removed without replacement",
                    ["reason"])
ENTRIES = Gauge("aiserve_cache_entries", "Entries in the exact-match tier")


# --- pb <-> domain, in one place -----------------------------------------------------------

def scope_from_pb(scope: cache_pb2.CacheScope) -> CacheScope:
    return CacheScope(model=scope.model, tenant=scope.tenant, params=scope.params)


def finish_reason_from_pb(value: int) -> str:
    """FINISH_REASON_STOP -> "stop"; unknown numbers -> "unknown" (refused by the store)."""
    try:
        return common_pb2.FinishReason.Name(value).removeprefix(_FINISH_PREFIX).lower()
    except ValueError:
        return "unknown"


def finish_reason_to_pb(reason: str) -> common_pb2.FinishReason:
    return common_pb2.FinishReason.Value(_FINISH_PREFIX + reason.upper())


def entry_to_pb(entry: CacheEntry) -> cache_pb2.LookupResponse:
    return cache_pb2.LookupResponse(
        hit=True, text=entry.text, token_ids=entry.token_ids,
        finish_reason=finish_reason_to_pb(entry.finish_reason),
        similarity=EXACT_SIMILARITY, entry_id=entry.entry_id,
    )


# --- the servicer ---------------------------------------------------------------------------

class CacheServicer(cache_pb2_grpc.CacheServicer):
    """Lookup and Store over one ExactCache."""

    def __init__(self, cache: ExactCache) -> None:
        self._cache = cache

    async def Lookup(
        self, request: cache_pb2.LookupRequest, context: aio.ServicerContext
    ) -> cache_pb2.LookupResponse:
        """The stored answer for this scope and prompt; a miss is ``hit=false``, not an error."""
        entry = await asyncio.to_thread(
            self._cache.lookup, scope_from_pb(request.scope), request.prompt)
        if entry is None:
            MISSES.inc()
            return cache_pb2.LookupResponse(hit=False)
        HITS.inc()
        return entry_to_pb(entry)

    async def Store(
        self, request: cache_pb2.StoreRequest, context: aio.ServicerContext
    ) -> cache_pb2.StoreResponse:
        """Store a normally finished answer; returns the new entry's id."""
        entry_id = await asyncio.to_thread(
            self._cache.store, scope_from_pb(request.scope), request.prompt, request.text,
            tuple(request.token_ids), finish_reason_from_pb(request.finish_reason))
        STORES.inc()
        return cache_pb2.StoreResponse(entry_id=entry_id)


def _count_eviction(reason: str, count: int) -> None:
    EVICTIONS.labels(reason).inc(count)


async def create_server(config: CacheConfig) -> ServiceHandle:
    """Open the cache file and build the (not yet started) server; the handle closes the file."""
    path = config.resolved_db_path()
    cache = await asyncio.to_thread(
        ExactCache, path, ttl_s=config.ttl_s, max_entries=config.max_entries,
        max_entry_bytes=config.max_entry_bytes, on_evict=_count_eviction)
    try:
        handle = new_server("cache", [SERVICE_NAME], config.host, config.port)
    except BaseException:
        cache.close()
        raise
    cache_pb2_grpc.add_CacheServicer_to_server(CacheServicer(cache), handle.server)
    ENTRIES.set_function(lambda: cache.num_entries)

    async def close() -> None:
        await asyncio.to_thread(cache.close)

    handle.on_close.append(close)
    log.info("cache_opened", path=str(path), entries=cache.num_entries)
    return handle


async def _run(config: CacheConfig) -> None:
    handle = await create_server(config)
    await serve(handle, config.grace_s)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m services.cache``."""
    config = load_config(CacheConfig, "cache", sys.argv[1:] if argv is None else argv)
    configure_logging("cache", config.log_level)
    start_metrics(config.metrics_port, config.host)
    asyncio.run(_run(config))
