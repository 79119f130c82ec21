"""The gateway's view of the backends: channels, the model route, and the pairing check.

A route is the model a request names (or the default) -> the tokenizer and inference services
that serve it. Before a route is used, the gateway checks that both serve the same
name@version with the same tokenizer fingerprint (DESIGN.md §5): a tokenizer of another version
would turn the model's ids into the wrong text, so that is FAILED_PRECONDITION, never served.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc import aio

from aiserve.common.errors import ApiError, ErrorKind, FailedPrecondition, NotFound, Unavailable, error_of
from aiserve.common.interceptors import downstream_channel
from aiserve.common.logging import get_logger
from aiserve.common.status import kind_of
from aiserve.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.gateway.config import GatewayConfig

INFO_TIMEOUT_S = 5.0
log = get_logger("backends")

# A backend's status that is the caller's own mistake (or a limit) reaches the caller as it is.
_PASS_THROUGH = frozenset({ErrorKind.INVALID_ARGUMENT, ErrorKind.NOT_FOUND, ErrorKind.FAILED_PRECONDITION,
                           ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.DEADLINE_EXCEEDED})


def status_error(service: str, code: grpc.StatusCode, details: str) -> ApiError | RuntimeError:
    """A backend's status as the caller should see it: its own code for a caller's mistake,
    UNAVAILABLE when the backend cannot be reached; anything else stays a bug (a RuntimeError,
    which the server interceptor reports as INTERNAL)."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{service} unavailable: {details}")
    if (kind := kind_of(code)) in _PASS_THROUGH:
        return error_of(kind, details)
    return RuntimeError(f"{service} failed with {code.name}: {details}")


def downstream_error(service: str, exc: grpc.RpcError) -> ApiError:
    """``status_error`` of a failed call; raises the RuntimeError of an unexpected code."""
    code = exc.code()  # type: ignore[attr-defined]
    error = status_error(service, code, exc.details() or code.name)  # type: ignore[attr-defined]
    if isinstance(error, RuntimeError):
        raise error from exc
    return error


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """What a checked route serves."""

    model: str
    context_length: int
    eos_token_ids: tuple[int, ...]


class Backends:
    """Channels to tokenizer, inference and cache, and the checked route to the model."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._channels: list[aio.Channel] = []
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._open(config.tokenizer_address))
        self.inference = inference_pb2_grpc.InferenceStub(self._open(config.inference_address))
        self.cache = (
            cache_pb2_grpc.CacheStub(self._open(config.cache_address)) if config.cache_address else None
        )
        self._checked: tuple[float, RouteInfo] | None = None
        self._lock = asyncio.Lock()

    def _open(self, address: str) -> aio.Channel:
        channel = downstream_channel(address)
        self._channels.append(channel)
        return channel

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def report_cache_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        """Tell the cache how an answer it served was rated (it may evict the entry). Best
        effort: the rating is already in the ledger, so a cache failure is only logged."""
        if self.cache is None or not entry_id:
            return
        request = cache_pb2.CacheFeedbackRequest(entry_id=entry_id, negative=is_negative, similarity=similarity)
        try:
            await self.cache.ReportFeedback(request, timeout=INFO_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("cache_feedback_failed", code=exc.code().name)  # type: ignore[attr-defined]

    def forget_route(self) -> None:
        """Re-check the pairing on the next request (after a backend failed or restarted)."""
        self._checked = None

    async def route(self, model: str) -> RouteInfo:
        """The route for ``model`` ('' = default), checked: NOT_FOUND / FAILED_PRECONDITION."""
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
                self.tokenizer.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=INFO_TIMEOUT_S,
                                    wait_for_ready=True),
                self.inference.Info(inference_pb2.InferenceInfoRequest(), timeout=INFO_TIMEOUT_S,
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
        return RouteInfo(
            model=inf.model,
            context_length=inf.context_length,
            eos_token_ids=tuple(inf.eos_token_ids),
        )
