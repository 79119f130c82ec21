"""What the cache tests share: a clock tests move, a removal recorder, and the gRPC calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from grpc import aio

from aiserve.common.config import config_with
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.config import CacheConfig

TIMEOUT_S = 10.0
SCOPE_PB = cache_pb2.CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="t=0")
STOP = common_pb2.FINISH_REASON_STOP
Q = "What is the capital of France?"


class FakeClock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Evictions:
    """Counts removals by reason, as the service's metrics do (a replaced entry is no eviction)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.ids: list[int] = []

    def __call__(self, reason: str, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        if reason != "replace":
            self.counts[reason] = self.counts.get(reason, 0) + len(ids)


def config_for(tmp_path: Path, **settings: object) -> CacheConfig:
    """The service's settings on a free port, with its files under ``tmp_path`` (flat setting names)."""
    return config_with(CacheConfig, port=0, metrics_port=0, db_path=str(tmp_path / "cache.sqlite3"), **settings)


def store_messages(
    query: str = Q, deltas: Sequence[tuple[str, list[int]]] = (("Paris", [12]), (".", [7])),
    finish: common_pb2.FinishReason = STOP, scope: cache_pb2.CacheScope = SCOPE_PB,
) -> list[cache_pb2.StoreRequest]:
    """A whole Store stream: header, deltas, finish."""
    messages = [cache_pb2.StoreRequest(header=cache_pb2.StoreHeader(scope=scope, prompt=f"<user>{query}",
                                                                    query=query))]
    messages += [cache_pb2.StoreRequest(delta=cache_pb2.AnswerDelta(text=t, token_ids=ids)) for t, ids in deltas]
    messages.append(cache_pb2.StoreRequest(finish=cache_pb2.StoreFinish(finish_reason=finish)))
    return messages


async def store(stub: cache_pb2_grpc.CacheStub, messages: list[cache_pb2.StoreRequest]) -> str:
    """Send a Store stream and half-close; the entry id, or the service's status as RpcError."""
    call = stub.Store(timeout=TIMEOUT_S)
    try:
        for message in messages:
            await call.write(message)
        await call.done_writing()
    except (asyncio.InvalidStateError, aio.AioRpcError):
        # The service refused the stream while we were still writing; depending on timing the
        # write itself fails locally. The call's own status (below) is what the service said.
        pass
    return (await call).entry_id


async def lookup(stub: cache_pb2_grpc.CacheStub, query: str, scope: cache_pb2.CacheScope = SCOPE_PB,
                 **kwargs: object) -> cache_pb2.LookupResponse:
    """Look ``query`` up, as its own prompt and as the query to embed."""
    request = cache_pb2.LookupRequest(scope=scope, prompt=f"<user>{query}", query=query, **kwargs)  # type: ignore[arg-type]
    return await stub.Lookup(request, timeout=TIMEOUT_S)
