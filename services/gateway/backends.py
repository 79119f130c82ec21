"""The gateway's backends at the edge: the replicas of each backend service (each with its own
channel, health watch and clients), the adapters the pipeline calls over them, the gateway's
own health, and the checked route to the model.

A route is the model a request names (or the default) -> the tokenizer and inference services
that serve it. Before an inference replica is used, the gateway checks that it and the
tokenizer serve the same name@version with the same tokenizer fingerprint: a tokenizer of
another version would turn the model's ids into the wrong text, so that is FAILED_PRECONDITION
(that replica is refused), never served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from aiserve.common.errors import FailedPrecondition, NotFound, Unavailable
from aiserve.v1 import inference_pb2, inference_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend_errors import downstream_error
from services.gateway.config import GatewayConfig
from services.gateway.domain import RouteInfo
from services.gateway.fleet_clients import FleetCache, FleetDetokenizer, FleetTokenizer
from services.gateway.fleet_inference import FleetGenerations, FleetRouter
from services.gateway.interfaces import PipelineBackends
from services.gateway.pool import ReplicaPool
from services.gateway.replica import Replica
from services.gateway.replica_clients import CacheClients, InferenceClients, TokenizerClients
from services.gateway.targets import parse_target

INFO_TIMEOUT_S = 5.0


class RouteChecker:
    """The ``Router`` of ``services/gateway/interfaces.py``: the pairing check, cached for
    ``fingerprint_ttl_s``."""

    def __init__(self, config: GatewayConfig, tokenizer: tokenizer_pb2_grpc.TokenizerStub | PickedTokenizer,
                 inference: inference_pb2_grpc.InferenceStub) -> None:
        self.config = config
        self._tokenizer, self._inference = tokenizer, inference
        self._checked: tuple[float, RouteInfo] | None = None
        self._lock = asyncio.Lock()

    def forget_route(self) -> None:
        """Re-check the pairing on the next request (after a backend failed or restarted)."""
        self._checked = None

    async def route(self, model: str) -> RouteInfo:
        """The route for ``model`` ('' = default), checked: NOT_FOUND / FAILED_PRECONDITION /
        UNAVAILABLE."""
        wanted = model or self.config.default_model
        if wanted != self.config.default_model:
            raise NotFound(f"model: {wanted!r} is not served; available: {self.config.default_model}")
        checked = self._checked
        if checked is not None and time.monotonic() - checked[0] < self.config.fingerprint_ttl_s:
            return checked[1]
        async with self._lock:
            info = await self._check_pairing(wanted)
            self._checked = (time.monotonic(), info)
            return info

    async def _check_pairing(self, wanted: str) -> RouteInfo:
        try:
            # wait_for_ready: a backend that just restarted is waited for (briefly) instead of
            # failing the request while the channel is still reconnecting.
            tok, inf = await asyncio.gather(
                self._tokenizer.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=INFO_TIMEOUT_S,
                                     wait_for_ready=True),
                self._inference.Info(inference_pb2.InferenceInfoRequest(), timeout=INFO_TIMEOUT_S,
                                     wait_for_ready=True),
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):  # type: ignore[attr-defined]
                raise Unavailable(f"tokenizer or inference did not answer within {INFO_TIMEOUT_S:.0f}s") from exc
            raise downstream_error("backend", exc) from exc
        if inf.model != wanted:
            raise NotFound(f"model: {wanted!r} is not loaded by inference (it serves {inf.model!r})")
        if tok.model != inf.model or tok.tokenizer_sha256 != inf.tokenizer_sha256:
            raise FailedPrecondition(
                f"tokenizer serves {tok.model} (tokenizer sha256 {tok.tokenizer_sha256[:12]}) but "
                f"inference serves {inf.model} (tokenizer sha256 {inf.tokenizer_sha256[:12]}); "
                "refusing to pair them"
            )
        return RouteInfo(model=inf.model, context_length=inf.context_length)


class PickedTokenizer:
    """The tokenizer's Info as the pairing check asks it: of the next SERVING tokenizer replica."""

    def __init__(self, pool: ReplicaPool[TokenizerClients]) -> None:
        self._pool = pool

    async def Info(  # noqa: N802 - the stub's method name
        self, request: tokenizer_pb2.TokenizerInfoRequest, *, timeout: float, wait_for_ready: bool,  # noqa: ASYNC109
    ) -> tokenizer_pb2.TokenizerInfo:
        replica = await self._pool.pick_ready(advance=False)  # a look: the turns are the requests'
        return await replica.clients.stub.Info(request, timeout=timeout,  # type: ignore[no-any-return]
                                               wait_for_ready=wait_for_ready)


SetServing = Callable[[bool, str], Awaitable[None]]


class Backends:
    """The replicas of tokenizer, inference and cache, and the adapters over them (``pipeline``)."""

    def __init__(self, config: GatewayConfig, cache_available: Callable[[bool], None] = lambda _: None) -> None:
        self.config = config
        self.changed = asyncio.Event()
        """Set by every replica's watch when its state changes (the gateway's health waits on it)."""
        route, interval = config.default_model, config.resolve_interval_s
        self.tokenizers = ReplicaPool("tokenizer", route, parse_target("tokenizer_address", config.tokenizer_address),
                                      TokenizerClients, interval, self.changed.set)
        tokenizer_info = PickedTokenizer(self.tokenizers)
        self.inference = ReplicaPool(
            "inference", route, parse_target("inference_address", config.inference_address),
            lambda channel: InferenceClients(channel, config.generate_mux,
                                             lambda stub: RouteChecker(config, tokenizer_info, stub)),
            interval, self.changed.set)
        self.caches: ReplicaPool[CacheClients] | None = None
        self.cache: FleetCache | None = None
        if config.cache_address:
            self.caches = ReplicaPool("cache", "", parse_target("cache_address", config.cache_address),
                                      CacheClients, interval, self._cache_changed)
            self.cache = FleetCache(self.caches, cache_available)
        self.router = FleetRouter(self.inference, config.fingerprint_ttl_s)
        self.pipeline = PipelineBackends(
            router=self.router,
            tokenizer=FleetTokenizer(self.tokenizers),
            generations=FleetGenerations(self.router),
            detokenizer=FleetDetokenizer(self.tokenizers),
            cache=self.cache,
        )

    def _cache_changed(self) -> None:
        if self.cache is not None:
            self.cache.on_change()
        self.changed.set()

    def pools(self) -> list[ReplicaPool[Any]]:
        """Tokenizer, inference, then cache (when there is one)."""
        return [self.tokenizers, self.inference, *([self.caches] if self.caches is not None else [])]

    def replicas(self) -> list[tuple[str, Replica[Any]]]:
        """Every replica with its route, by route, then service, then address."""
        found = [(pool.route, replica) for pool in self.pools() for replica in pool.replicas]
        return sorted(found, key=lambda item: (item[0], item[1].service, item[1].address))

    def health(self) -> tuple[bool, str]:
        """SERVING while the route has a SERVING tokenizer replica and a usable inference replica
        (the cache does not count: without it caching is skipped; only at the start its first
        answer is awaited); else the reason."""
        problems = [f"{pool.service}: {pool.replicas.why_none()}" for pool in (self.tokenizers, self.inference)
                    if not pool.replicas.usable()]
        if self.caches is not None and not self.caches.has_settled:
            problems.append("cache: connecting")  # once: so the first requests know whether to cache
        return not problems, "; ".join(problems)

    async def health_loop(self, set_serving: SetServing) -> None:
        """Report ``health`` now and after every change a replica's watch records."""
        while True:
            self.changed.clear()
            await set_serving(*self.health())
            await self.changed.wait()

    async def close(self) -> None:
        """Close every replica: its shared calls end, then its channel."""
        await asyncio.gather(*(pool.close() for pool in self.pools()))
