"""The model routes and their versions, and which version serves a request (pure logic).

A route is a model name served by one or more versions (name@version), each by its own
tokenizer and inference targets, each with a weight (docs/gateway.md, "Routes and versions").
A request naming name@version goes to that version; one naming the route (or "" for the
default route) is routed by the weights over the versions with weight > 0 that serve now. A
sticky key (the tenant, or the session) is hashed into [0, total weight): the same key lands on
the same version for given weights, and moving weight moves only a proportional share of keys.

No grpc, no sqlite, no clock of its own (``clock`` is given): unit-tested with plain values.
The admin changes raise before they change anything, so a refused change leaves the table as
it was; ``routing.py`` applies each to a copy and keeps it once it is stored.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiserve.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

MAX_WEIGHT = 1_000_000
_HASH_SPAN = float(1 << 64)


class Role(enum.Enum):
    """A version's place on its route."""

    STABLE = "stable"
    CANARY = "canary"
    RETIRING = "retiring"


class Stickiness(enum.Enum):
    """What keeps requests on one version (the setting ``route_stickiness``)."""

    NONE = "none"
    TENANT = "tenant"
    SESSION = "session"


@dataclass
class Version:
    """One version of a route and the targets of its replicas."""

    model: str
    tokenizer_target: str
    inference_target: str
    weight: int
    role: Role
    rolled_back_reason: str = ""
    retire_at: float = 0.0
    """Unix seconds when a RETIRING version leaves the route (0 otherwise)."""


@dataclass
class Route:
    """A model name and its versions, in the order they were added."""

    name: str
    stickiness: Stickiness
    versions: list[Version] = field(default_factory=list)

    @property
    def stable(self) -> Version:
        return next(v for v in self.versions if v.role is Role.STABLE)

    def version(self, model: str) -> Version | None:
        return next((v for v in self.versions if v.model == model), None)


def route_name(model: str) -> str:
    """The route a model reference belongs to: "name@version" -> "name"."""
    return model.split("@", 1)[0]


class RouteTable:
    """Every route, the default route's name, and the admin changes (``clock``: Unix seconds;
    ``rand``: a draw in [0, 1) for a request without a sticky key)."""

    def __init__(self, routes: list[Route], default_name: str, clock: Callable[[], float],
                 rand: Callable[[], float] = random.random) -> None:
        self.routes = {r.name: r for r in routes}
        self.default_name = default_name if default_name in self.routes else next(iter(self.routes), "")
        self.clock, self.rand = clock, rand

    def copy(self) -> RouteTable:
        """A deep copy to change (the original stays as it is until the copy is kept)."""
        return RouteTable(copy.deepcopy(list(self.routes.values())), self.default_name, self.clock, self.rand)

    def versions(self) -> list[Version]:
        return [v for r in self.routes.values() for v in r.versions]

    def served(self) -> str:
        """Every version, for a NOT_FOUND message."""
        return ", ".join(v.model for v in self.versions()) or "nothing"

    def route(self, name: str) -> Route:
        if (found := self.routes.get(name)) is None:
            raise NotFound(f"route: {name!r} is not a route; routes: {', '.join(self.routes) or 'none'}")
        return found

    def version(self, model: str) -> tuple[Route, Version]:
        route = self.routes.get(route_name(model))
        version = route.version(model) if route is not None else None
        if route is None or version is None:
            raise NotFound(f"model: {model!r} is not on a route; available: {self.served()}")
        return route, version

    # --- which version serves a request ------------------------------------------------------

    def pick(self, model: str, key: str, is_serving: Callable[[str], bool]) -> Version:
        """The version for a request naming ``model`` ("" = the default route); ``key`` is its
        sticky key ("" = none: a random draw). Falls back to the stable version when no version
        with weight > 0 serves (its own error then says why)."""
        wanted = model or self.default_name
        route = self.routes.get(route_name(wanted))
        if route is None or ("@" in wanted and route.version(wanted) is None):
            raise NotFound(f"model: {wanted!r} is not served; available: {self.served()}")
        if "@" in wanted:
            return route.version(wanted)  # type: ignore[return-value]
        candidates = [v for v in route.versions if v.weight > 0 and is_serving(v.model)]
        if not candidates:
            return route.stable
        total = sum(v.weight for v in candidates)
        point = (_share(route.name, key) if key else self.rand()) * total
        for version in candidates:
            point -= version.weight
            if point < 0:
                return version
        return candidates[-1]  # float rounding at the very end

    # --- admin changes -----------------------------------------------------------------------

    def add_version(self, version: Version, stickiness: Stickiness) -> Route:
        """Add ``version`` (its role is set here); a new name makes a new route, whose first
        version is its stable one (at weight 100 when given 0: a route needs traffic)."""
        _check_weight(version.model, version.weight)
        name = route_name(version.model)
        route = self.routes.get(name)
        if route is None:
            version.role, version.weight = Role.STABLE, version.weight or 100
            route = self.routes[name] = Route(name, stickiness, [version])
            self.default_name = self.default_name or name
            return route
        if route.version(version.model) is not None:
            raise AlreadyExists(f"model: {version.model!r} is on its route already")
        version.role = Role.CANARY
        route.versions.append(version)
        return route

    def set_weights(self, name: str, weights: Mapping[str, int]) -> Route:
        """Set some versions' weights; the others keep theirs."""
        route = self.route(name)
        for model, weight in weights.items():
            version = route.version(model)
            if version is None:
                raise NotFound(f"weights: {model!r} is not a version of route {name!r}")
            _check_weight(model, weight)
            if weight and version.role is Role.RETIRING:
                raise InvalidArgument(f"weights: {model!r} is retiring and takes no traffic (promote it instead)")
        if not any(weights.get(v.model, v.weight) > 0 for v in route.versions):
            raise InvalidArgument(f"weights: no version of route {name!r} would keep a weight above 0")
        for version in route.versions:
            version.weight = weights.get(version.model, version.weight)
        return route

    def promote(self, model: str, retire_after_s: float) -> Route:
        """``model`` becomes stable at 100, every other version 0; the former stable version
        is RETIRING until now + ``retire_after_s``."""
        route, chosen = self.version(model)
        if chosen.role is not Role.STABLE:
            former = route.stable
            former.role, former.retire_at = Role.RETIRING, self.clock() + retire_after_s
        chosen.role, chosen.weight, chosen.retire_at = Role.STABLE, 100, 0.0
        for version in route.versions:
            if version is not chosen:
                version.weight = 0
        return route

    def rollback(self, name: str, reason: str) -> Route:
        """Canaries with traffic go to 0 (keeping ``reason``), the stable version to 100."""
        route = self.route(name)
        for version in route.versions:
            if version.role is Role.CANARY and version.weight > 0:
                version.weight, version.rolled_back_reason = 0, reason
        route.stable.weight = 100
        return route

    def remove_version(self, model: str) -> Route:
        """Drop a version that is not the stable one (and not the last one with traffic)."""
        route, version = self.version(model)
        if version.role is Role.STABLE:
            raise FailedPrecondition(f"model: {model!r} is the stable version of its route (promote another first)")
        if version.weight > 0 and not any(v.weight > 0 for v in route.versions if v is not version):
            raise FailedPrecondition(f"model: {model!r} is the only version of its route with weight above 0 "
                                     "(set weights first)")
        route.versions.remove(version)
        return route

    def retire_due(self) -> list[Version]:
        """Drop the RETIRING versions whose time has come; returns them."""
        now, dropped = self.clock(), []
        for route in self.routes.values():
            due = [v for v in route.versions if v.role is Role.RETIRING and v.retire_at <= now]
            route.versions = [v for v in route.versions if v not in due]
            dropped += due
        return dropped

    def next_retire_at(self) -> float | None:
        """When the next RETIRING version is due (None: none is retiring)."""
        return min((v.retire_at for v in self.versions() if v.role is Role.RETIRING), default=None)


def _share(route: str, key: str) -> float:
    """``key``'s fixed place in [0, 1) on ``route`` (sha256: the same on every gateway)."""
    digest = hashlib.sha256(f"{route}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _HASH_SPAN


def _check_weight(model: str, weight: int) -> None:
    if not 0 <= weight <= MAX_WEIGHT:
        raise InvalidArgument(f"weight: {model!r} must be 0..{MAX_WEIGHT}, got {weight}")
