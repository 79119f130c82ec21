"""One version of a model route at the edge: its own tokenizer and inference replicas (each
with its own channel, health watch and clients), its own pairing check, and the adapters the
pipeline calls over them.

Before an inference replica is used, the gateway checks that it and the version's tokenizer
serve the same name@version with the same tokenizer fingerprint: a tokenizer of another version
would turn the model's ids into the wrong text, so that is FAILED_PRECONDITION (that replica is
refused), never served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from aiserve.common.errors import FailedPrecondition, NotFound, Unavailable
from aiserve.v1 import inference_pb2, inference_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend_errors import downstream_error
from services.gateway.config import GatewayConfig
from services.gateway.domain import RouteInfo
from services.gateway.fleet_clients import FleetDetokenizer, FleetTokenizer
from services.gateway.fleet_inference import FleetGenerations, FleetRouter
from services.gateway.pool import ReplicaPool
from services.gateway.replica_clients import InferenceClients, TokenizerClients
from services.gateway.targets import parse_target

INFO_TIMEOUT_S = 5.0


class RouteChecker:
    """The ``Router`` of ``services/gateway/interfaces.py``: the pairing check, cached for
    ``fingerprint_ttl_s``."""

    def __init__(self, config: GatewayConfig, tokenizer: tokenizer_pb2_grpc.TokenizerStub | PickedTokenizer,
                 inference: inference_pb2_grpc.InferenceStub, model: str = "") -> None:
        self.config = config
        self.model = model or config.default_model
        """The name@version this pairing serves (a version of a route)."""
        self._tokenizer, self._inference = tokenizer, inference
        self._checked: tuple[float, RouteInfo] | None = None
        self._lock = asyncio.Lock()

    def forget_route(self) -> None:
        """Re-check the pairing on the next request (after a backend failed or restarted)."""
        self._checked = None

    async def route(self, model: str) -> RouteInfo:
        """The route for ``model`` ('' = its own version), checked: NOT_FOUND / FAILED_PRECONDITION
        / UNAVAILABLE."""
        wanted = model or self.model
        if wanted != self.model:
            raise NotFound(f"model: {wanted!r} is not served; available: {self.model}")
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


class VersionBackends:
    """The replicas and adapters of one version (``model``, name@version) of a route."""

    def __init__(self, config: GatewayConfig, model: str, tokenizer_target: str, inference_target: str,
                 on_change: Callable[[], None]) -> None:
        self.model = model
        interval = config.resolve_interval_s
        self.tokenizers = ReplicaPool("tokenizer", model, parse_target("tokenizer_target", tokenizer_target),
                                      TokenizerClients, interval, on_change)
        tokenizer_info = PickedTokenizer(self.tokenizers)
        self.inference = ReplicaPool(
            "inference", model, parse_target("inference_target", inference_target),
            lambda channel: InferenceClients(channel, config.generate_mux,
                                             lambda stub: RouteChecker(config, tokenizer_info, stub, model)),
            interval, on_change)
        self.router = FleetRouter(self.inference, config.fingerprint_ttl_s)
        self.tokenizer = FleetTokenizer(self.tokenizers)
        self.generations = FleetGenerations(self.router)
        self.detokenizer = FleetDetokenizer(self.tokenizers)
        self.in_flight = 0
        """Requests routed here that have not finished (a removed version closes at 0)."""

    def pools(self) -> list[ReplicaPool[Any]]:
        return [self.tokenizers, self.inference]

    def problems(self) -> list[str]:
        """Why it cannot serve now ([] while a tokenizer and an inference replica are usable)."""
        return [f"{pool.service}: {pool.replicas.why_none()}" for pool in self.pools() if not pool.replicas.usable()]

    @property
    def is_serving(self) -> bool:
        return all(pool.replicas.usable() for pool in self.pools())

    async def close(self) -> None:
        """Close every replica: its shared calls end, then its channel."""
        await asyncio.gather(*(pool.close() for pool in self.pools()))
