"""The gateway's backends at the edge: the model routes (each version with its own tokenizer
and inference replicas, ``routing.py``), the shared cache replicas, the adapters the pipeline
calls over them, and the gateway's own health.

The cache is one pool for every route: a cached answer's namespace carries the exact
name@version that answered (``cache_keys.py``), so versions never share answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.config import GatewayConfig
from services.gateway.fleet_clients import FleetCache
from services.gateway.interfaces import PipelineBackends
from services.gateway.pool import ReplicaPool
from services.gateway.replica import Replica
from services.gateway.replica_clients import CacheClients
from services.gateway.route_store import RouteStore
from services.gateway.routed import RoutedDetokenizer, RoutedGenerations, RoutedTokenizer
from services.gateway.routing import Routes
from services.gateway.targets import parse_target
from services.gateway.version_backends import VersionBackends

SetServing = Callable[[bool, str], Awaitable[None]]


class Backends:
    """The routes' replicas, the cache's, and the adapters over them (``pipeline``).

    ``store`` None: the routes are the settings' and live in memory only."""

    def __init__(self, config: GatewayConfig, cache_available: Callable[[bool], None] = lambda _: None,
                 store: RouteStore | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.changed = asyncio.Event()
        """Set by every replica's watch when its state changes, and by every route change (the
        gateway's health waits on it)."""
        self.routes = Routes(config, store, self.changed.set, clock)
        self.caches: ReplicaPool[CacheClients] | None = None
        self.cache: FleetCache | None = None
        if config.cache_address:
            self.caches = ReplicaPool("cache", "", parse_target("cache_address", config.cache_address),
                                      CacheClients, config.resolve_interval_s, self._cache_changed)
            self.cache = FleetCache(self.caches, cache_available)
        self.pipeline = PipelineBackends(
            router=self.routes,
            tokenizer=RoutedTokenizer(self.routes),
            generations=RoutedGenerations(self.routes),
            detokenizer=RoutedDetokenizer(self.routes),
            cache=self.cache,
        )

    @property
    def default(self) -> VersionBackends:
        """The default route's stable version."""
        table = self.routes.table
        return self.routes.backends_of(table.route(table.default_name).stable.model)

    @property
    def tokenizers(self) -> ReplicaPool[Any]:
        """The default route's stable version's tokenizer replicas."""
        return self.default.tokenizers

    @property
    def inference(self) -> ReplicaPool[Any]:
        """The default route's stable version's inference replicas."""
        return self.default.inference

    def _cache_changed(self) -> None:
        if self.cache is not None:
            self.cache.on_change()
        self.changed.set()

    def pools(self) -> list[ReplicaPool[Any]]:
        """Every version's tokenizer and inference, then the cache (when there is one)."""
        versions = [pool for backends in self.routes.all_backends() for pool in backends.pools()]
        return [*versions, *([self.caches] if self.caches is not None else [])]

    def replicas(self) -> list[tuple[str, Replica[Any]]]:
        """Every replica with its route (name@version), by route, then service, then address."""
        found = [(pool.route, replica) for pool in self.pools() for replica in pool.replicas]
        return sorted(found, key=lambda item: (item[0], item[1].service, item[1].address))

    def health(self) -> tuple[bool, str]:
        """SERVING while every route's stable version has a SERVING tokenizer replica and a
        usable inference replica (canaries and retiring versions do not count, nor does the
        cache, whose first answer only is awaited at the start); else the reason."""
        table = self.routes.table
        problems = []
        for route in table.routes.values():
            stable = self.routes.backends_of(route.stable.model)
            prefix = f"{stable.model}: " if len(table.routes) > 1 else ""
            problems += [prefix + problem for problem in stable.problems()]
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
        await asyncio.gather(self.routes.close(), *([self.caches.close()] if self.caches is not None else []))
