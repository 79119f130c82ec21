"""The model routes as the Admin service answers them: domain routes -> pb
(protos/aiserve/v1/admin.proto), with each version's state from its replicas and its figures
from the gateway's ``RequestObserver``.
"""

from __future__ import annotations

from aiserve.v1 import admin_pb2, status_pb2
from services.gateway.domain import VersionFigures
from services.gateway.interfaces import RequestObserver
from services.gateway.route_table import Role, Route, Stickiness, Version
from services.gateway.routing import Routes

_ROLES = {Role.STABLE: admin_pb2.VERSION_ROLE_STABLE, Role.CANARY: admin_pb2.VERSION_ROLE_CANARY,
          Role.RETIRING: admin_pb2.VERSION_ROLE_RETIRING}
_STICKINESS = {Stickiness.NONE: admin_pb2.STICKINESS_NONE, Stickiness.TENANT: admin_pb2.STICKINESS_TENANT,
               Stickiness.SESSION: admin_pb2.STICKINESS_SESSION}


def route_to_pb(route: Route, routes: Routes, observer: RequestObserver) -> admin_pb2.Route:
    """``route`` with each version's state now and its figures."""
    return admin_pb2.Route(name=route.name, stickiness=_STICKINESS[route.stickiness],
                           versions=[version_to_pb(v, routes, observer) for v in route.versions])


def version_to_pb(version: Version, routes: Routes, observer: RequestObserver) -> admin_pb2.RouteVersion:
    backends = routes.versions.get(version.model)
    problems = backends.problems() if backends is not None else ["not loaded"]
    state = status_pb2.SERVING_STATE_NOT_SERVING if problems else status_pb2.SERVING_STATE_SERVING
    return admin_pb2.RouteVersion(
        model=version.model, weight=version.weight, role=_ROLES[version.role],
        tokenizer_target=version.tokenizer_target, inference_target=version.inference_target,
        state=state, reason="; ".join(problems), rolled_back_reason=version.rolled_back_reason,
        retire_at_unix_s=version.retire_at, figures=figures_to_pb(observer.figures(version.model)))


def figures_to_pb(figures: VersionFigures) -> admin_pb2.VersionFigures:
    return admin_pb2.VersionFigures(
        window_s=figures.window_s, requests=figures.requests, error_rate=figures.error_rate,
        ttft_p50_ms=figures.ttft_p50_ms, ttft_p95_ms=figures.ttft_p95_ms, tpot_p50_ms=figures.tpot_p50_ms,
        tpot_p95_ms=figures.tpot_p95_ms, cache_hit_rate=figures.cache_hit_rate,
        mean_cost_micros=figures.mean_cost_micros, negative_feedback_rate=figures.negative_feedback_rate)
