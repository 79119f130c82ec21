"""The model routes as the gateway serves them: the route table (``route_table.py``), each
version's replicas (``version_backends.py``), the routes file (``route_store.py``) and the
retirement of former stable versions.

The ``Router`` of ``services/gateway/interfaces.py``: ``pick`` chooses the version of a request,
``route`` checks its pairing; the request then runs on that version's backends (``routed.py``
looks them up by the exact name@version) and ``release`` ends its hold. A version dropped from its
route takes no new request, and its replicas are closed once its last request released it, so
streams in flight finish where they started.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Mapping

from aiserve.common.config import ConfigError
from aiserve.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from aiserve.common.logging import get_logger
from aiserve.store import is_model_ref
from services.gateway.changes import Changes
from services.gateway.config import GatewayConfig
from services.gateway.domain import RouteInfo
from services.gateway.route_store import RouteStore
from services.gateway.route_table import Role, Route, RouteTable, Stickiness, Version, route_name
from services.gateway.targets import parse_target
from services.gateway.version_backends import VersionBackends

log = get_logger("routes")

MAX_RETIRE_WAIT_S = 60.0


def seed_route(config: GatewayConfig) -> Route:
    """The settings' route: ``default_model`` on tokenizer_address / inference_address, STABLE at 100."""
    version = Version(config.default_model, config.tokenizer_address, config.inference_address, 100, Role.STABLE)
    return Route(route_name(config.default_model), Stickiness(config.route_stickiness), [version])


class Routes:
    """Every route's versions and their backends; the admin changes, stored before they apply."""

    def __init__(self, config: GatewayConfig, store: RouteStore | None, on_change: Callable[[], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.config, self._store, self._on_change = config, store, on_change
        saved = store.load() if store is not None else []
        for route in saved:  # the setting says how every route sticks (no rpc sets it per route)
            route.stickiness = Stickiness(config.route_stickiness)
        self.table = RouteTable(saved or [seed_route(config)], route_name(config.default_model), clock)
        self.versions: dict[str, VersionBackends] = {}
        self._draining: dict[str, VersionBackends] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        """Set by every change: the retirement loop looks again at when the next one is due."""
        self._changes = Changes(on_change)
        """Every change and every dropped version closed (``wait_for`` waits on it)."""
        self._sync()
        self._retirer = asyncio.get_running_loop().create_task(self._retire_loop(), context=contextvars.Context())

    # --- requests ----------------------------------------------------------------------------

    def pick(self, model: str, tenant: str = "", session: str = "") -> str:
        """The version for a request naming ``model`` ("" = the default route, "name" = by the
        weights, "name@version" = that one); the request holds it until ``release``."""
        version = self.table.pick(model, self._sticky_key(tenant, session), self._is_serving)
        self.versions[version.model].in_flight += 1
        return version.model

    async def route(self, model: str) -> RouteInfo:
        """The checked route of the version ``model`` (the pairing of one of its replicas)."""
        return await self.backends_of(model).router.route(model)

    def release(self, model: str) -> None:
        """A request routed to ``model`` finished (its version may close now if dropped)."""
        backends = self.versions.get(model) or self._draining.get(model)
        if backends is None:
            return
        backends.in_flight -= 1
        if backends.in_flight <= 0 and self._draining.get(model) is backends:
            self._close(self._draining.pop(model))
            self._changes.notify()

    def forget_route(self) -> None:
        """Nothing to forget: each version's replicas are checked again when they turn SERVING
        anew and after ``fingerprint_ttl_s`` (``fleet_inference.py``)."""

    def backends_of(self, model: str) -> VersionBackends:
        """The backends of the exact version ``model`` (also while it drains)."""
        found = self.versions.get(model) or self._draining.get(model)
        if found is None:
            raise Unavailable(f"model: {model!r} was dropped from its route")
        return found

    def _sticky_key(self, tenant: str, session: str) -> str:
        stickiness = Stickiness(self.config.route_stickiness)
        return {Stickiness.NONE: "", Stickiness.TENANT: tenant, Stickiness.SESSION: session}[stickiness]

    def _is_serving(self, model: str) -> bool:
        return (found := self.versions.get(model)) is not None and found.is_serving

    # --- admin changes -----------------------------------------------------------------------

    def add_version(self, model: str, tokenizer_target: str, inference_target: str, weight: int) -> Route:
        if not is_model_ref(model):
            raise InvalidArgument(f"model: must be 'name@version', got {model!r}")
        for name, target in (("tokenizer_target", tokenizer_target), ("inference_target", inference_target)):
            try:
                parse_target(name, target)
            except ConfigError as exc:
                raise InvalidArgument(str(exc)) from None
        if model in self._draining:
            raise FailedPrecondition(f"model: {model!r} was dropped and still finishes its streams; add it again "
                                     "once they ended")
        version = Version(model, tokenizer_target, inference_target, weight, Role.CANARY)
        stickiness = Stickiness(self.config.route_stickiness)
        return self._change(lambda table: table.add_version(version, stickiness))

    def set_weights(self, name: str, weights: Mapping[str, int]) -> Route:
        return self._change(lambda table: table.set_weights(name, weights))

    def promote(self, model: str, retire_after_s: float) -> Route:
        after = retire_after_s or self.config.retire_after_s
        if not 0 <= after <= 7 * 86_400:
            raise InvalidArgument(f"retire_after_s: must be in [0, 604800], got {retire_after_s}")
        return self._change(lambda table: table.promote(model, after))

    def rollback(self, name: str, reason: str) -> Route:
        return self._change(lambda table: table.rollback(name, reason))

    def remove_version(self, model: str) -> Route:
        return self._change(lambda table: table.remove_version(model))

    def retire_due(self) -> list[Version]:
        """Drop the RETIRING versions whose time has come (stored, then their replicas drain)."""
        if (due := self.table.next_retire_at()) is None or due > self.table.clock():
            return []
        changed = self.table.copy()
        dropped = changed.retire_due()
        self._keep(changed)
        for version in dropped:
            log.info("version_retired", model=version.model)
        return dropped

    def _change(self, change: Callable[[RouteTable], Route]) -> Route:
        """Apply ``change`` to a copy, store it, then serve it (a refused change changes nothing)."""
        changed = self.table.copy()
        route = change(changed)
        self._keep(changed)
        log.info("route_changed", route=route.name,
                 versions=[f"{v.model}={v.weight}/{v.role.value}" for v in route.versions])
        return route

    def _keep(self, changed: RouteTable) -> None:
        if self._store is not None:
            self._store.save(list(changed.routes.values()))
        self.table = changed
        self._sync()
        self._wake.set()
        self._changes.notify()

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``condition()`` holds, checked after each change of the routes or their
        versions' lifetimes (TimeoutError after ``timeout_s``)."""
        await self._changes.wait_for(condition, timeout_s)

    def _sync(self) -> None:
        """Backends for every version on a route; a dropped version drains, then closes."""
        wanted = {v.model: v for v in self.table.versions()}
        for model in set(self.versions) - set(wanted):
            backends = self.versions.pop(model)
            if backends.in_flight > 0:
                self._draining[model] = backends
            else:
                self._close(backends)
        for model, version in wanted.items():
            if model not in self.versions:
                self.versions[model] = VersionBackends(self.config, model, version.tokenizer_target,
                                                       version.inference_target, self._on_change)

    def _close(self, backends: VersionBackends) -> None:
        log.info("version_closed", model=backends.model)
        task = asyncio.get_running_loop().create_task(backends.close(), context=contextvars.Context())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _retire_loop(self) -> None:
        """Drop each RETIRING version when it is due (woken by every change)."""
        while True:
            self._wake.clear()
            due = self.table.next_retire_at()
            wait = MAX_RETIRE_WAIT_S if due is None else due - self.table.clock()
            try:
                async with asyncio.timeout(min(max(wait, 0.0), MAX_RETIRE_WAIT_S)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            try:
                self.retire_due()
            except Exception:  # noqa: BLE001 - a failed save is retried at the next turn
                log.exception("retire_failed")
                await asyncio.sleep(1.0)

    def all_backends(self) -> list[VersionBackends]:
        """Every version's backends, draining ones too."""
        return [*self.versions.values(), *self._draining.values()]

    async def close(self) -> None:
        """Stop retiring; close every version's replicas."""
        self._retirer.cancel()
        await asyncio.gather(self._retirer, return_exceptions=True)
        await asyncio.gather(*(b.close() for b in self.all_backends()), *self._closing, return_exceptions=True)
