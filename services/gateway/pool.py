"""The replicas one target names, kept up to date: a ``Replica`` per address (``replica.py``),
in a ``ReplicaSet`` (``replicas.py``) that picks round-robin over the SERVING ones.

The edge. A ``dns:///`` target is resolved again every ``resolve_interval_s``: a new address
gets a replica (its own channel, watch and clients), a vanished one is closed. A pool that is
still settling (a new replica's watch has not answered yet, or the name was never resolved)
lets a request wait for it briefly instead of failing it, as a freshly started gateway would
otherwise refuse its first requests.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Collection
from typing import Generic

from grpc import aio

from aiserve.common.logging import get_logger
from services.gateway.changes import Changes
from services.gateway.replica import C, Replica
from services.gateway.replicas import ReplicaSet
from services.gateway.targets import GetAddrInfo, Target, resolve

log = get_logger("pool")

SETTLE_WAIT_S = 5.0
"""How long a request waits for a settling pool to have a replica SERVING."""


class ReplicaPool(Generic[C]):
    """``service``'s replicas at ``target`` (``route``: the model route they serve, "" for any)."""

    def __init__(self, service: str, route: str, target: Target, make_clients: Callable[[aio.Channel], C],
                 resolve_interval_s: float, on_change: Callable[[], None],
                 getaddrinfo: GetAddrInfo | None = None) -> None:
        self.service, self.route, self.target = service, route, target
        self._getaddrinfo = getaddrinfo  # None: the event loop's
        self.replicas: ReplicaSet[Replica[C]] = ReplicaSet(service)
        self._make_clients = make_clients
        self._changes = Changes(on_change)
        self._is_resolved = not target.is_dns
        self._has_settled = False
        self._closing: set[asyncio.Task[None]] = set()
        for address in target.addresses:
            self._add(address)
        self._resolver: asyncio.Task[None] | None = None
        if target.is_dns:
            self._resolver = asyncio.get_running_loop().create_task(
                self._resolve_every(resolve_interval_s), context=contextvars.Context())

    @property
    def has_settled(self) -> bool:
        """Whether the pool has once stopped settling (every first watch answered)."""
        self._has_settled = self._has_settled or not self.is_settling
        return self._has_settled

    @property
    def is_settling(self) -> bool:
        """Not resolved yet, or a replica whose watch has not answered yet."""
        return not self._is_resolved or any(not r.has_answered for r in self.replicas)

    def pick(self, exclude: Collection[str] = (), advance: bool = True) -> Replica[C]:
        """The next SERVING replica now (Unavailable naming each one's reason when none is)."""
        return self.replicas.pick(exclude, advance)

    async def pick_ready(self, exclude: Collection[str] = (), advance: bool = True,
                         timeout_s: float = SETTLE_WAIT_S) -> Replica[C]:
        """``pick``, waiting up to ``timeout_s`` while the pool is settling."""
        try:
            await self.wait_for(lambda: bool(self.replicas.usable(exclude)) or not self.is_settling, timeout_s)
        except TimeoutError:
            pass
        return self.replicas.pick(exclude, advance)

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``condition()`` holds, checked after each change (TimeoutError after
        ``timeout_s``)."""
        await self._changes.wait_for(condition, timeout_s)

    def _add(self, address: str) -> None:
        self.replicas.add(Replica(self.service, address, self._make_clients, self._changes.notify))

    def update(self, addresses: Collection[str]) -> None:
        """Replicas for exactly ``addresses``: new ones added, vanished ones closed."""
        for gone in set(self.replicas.addresses()) - set(addresses):
            if (replica := self.replicas.remove(gone)) is not None:
                log.info("replica_removed", service=self.service, address=gone)
                task = asyncio.get_running_loop().create_task(replica.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        for address in addresses:
            if address not in self.replicas.addresses():
                log.info("replica_added", service=self.service, address=address)
                self._add(address)
        self._changes.notify()

    async def _resolve_every(self, interval_s: float) -> None:
        while True:
            try:
                addresses = await resolve(self.target, self._getaddrinfo)
            except OSError as exc:  # the replicas known stay (a name server's hiccup is no outage)
                log.warning("resolve_failed", service=self.service, target=self.target.text, error=str(exc))
            else:
                if set(addresses) != set(self.replicas.addresses()):
                    self.update(addresses)
            if not self._is_resolved:
                self._is_resolved = True
                self._changes.notify()
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Stop resolving; close every replica."""
        if (resolver := self._resolver) is not None:
            resolver.cancel()
            await asyncio.gather(resolver, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in self.replicas), *self._closing, return_exceptions=True)
