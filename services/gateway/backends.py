"""The gateway's backends at the edge: the channels, the gRPC adapters the pipeline calls, and
the checked route to the model.

A route is the model a request names (or the default) -> the tokenizer and inference services
that serve it. Before a route is used, the gateway checks that both serve the same
name@version with the same tokenizer fingerprint: a tokenizer of another version would turn
the model's ids into the wrong text, so that is FAILED_PRECONDITION, never served.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc import aio

from aiserve.common.errors import FailedPrecondition, NotFound, Unavailable
from aiserve.common.interceptors import downstream_channel
from aiserve.v1 import (
    cache_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.gateway.backend_errors import downstream_error
from services.gateway.cache_client import CacheClient
from services.gateway.config import GatewayConfig
from services.gateway.detokenize_mux_client import DetokenizeMuxClient
from services.gateway.domain import RouteInfo
from services.gateway.generate_call_client import GenerateCallClient
from services.gateway.generate_mux_client import GenerateMuxClient
from services.gateway.interfaces import PipelineBackends
from services.gateway.tokenizer_client import TokenizerClient

INFO_TIMEOUT_S = 5.0


class RouteChecker:
    """The ``Router`` of ``services/gateway/interfaces.py``: the pairing check, cached for
    ``fingerprint_ttl_s``."""

    def __init__(self, config: GatewayConfig, tokenizer: tokenizer_pb2_grpc.TokenizerStub,
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


class Backends:
    """Channels to tokenizer, inference and cache, and the adapters over them (``pipeline``)."""

    def __init__(self, config: GatewayConfig) -> None:
        self._channels: list[aio.Channel] = []
        tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._open(config.tokenizer_address))
        inference = inference_pb2_grpc.InferenceStub(self._open(config.inference_address))
        cache = cache_pb2_grpc.CacheStub(self._open(config.cache_address)) if config.cache_address else None
        self.detokenizer = DetokenizeMuxClient(tokenizer)  # one call shared by all generations
        self.generations = (  # likewise, unless a balancer needs a call each (docs/decisions.md, 34)
            GenerateMuxClient(inference) if config.generate_mux else GenerateCallClient(inference))
        self.pipeline = PipelineBackends(
            router=RouteChecker(config, tokenizer, inference),
            tokenizer=TokenizerClient(tokenizer),
            generations=self.generations,
            detokenizer=self.detokenizer,
            cache=CacheClient(cache) if cache is not None else None,
        )

    def _open(self, address: str) -> aio.Channel:
        channel = downstream_channel(address)
        self._channels.append(channel)
        return channel

    async def close(self) -> None:
        """End the shared calls, then close the channels."""
        await self.generations.close()
        await self.detokenizer.close()
        for channel in self._channels:
            await channel.close()
