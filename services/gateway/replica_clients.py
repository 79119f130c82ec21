"""The clients each replica owns, over its own channel (``replica.py`` builds them).

A tokenizer replica has its own unary client and its own shared DetokenizeMux call; an
inference replica its own GenerateMux call (or a Generate call per generation) and its own
pairing check; a cache replica its own cache client. One shared call per replica, never one
for the whole target: a call is an HTTP/2 stream, which lives on one connection to one replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from grpc import aio

from aiserve.v1 import cache_pb2_grpc, inference_pb2_grpc, tokenizer_pb2_grpc
from services.gateway.cache_client import CacheClient
from services.gateway.detokenize_mux_client import DetokenizeMuxClient
from services.gateway.domain import RouteInfo
from services.gateway.generate_call_client import GenerateCallClient
from services.gateway.generate_mux_client import GenerateMuxClient
from services.gateway.tokenizer_client import TokenizerClient


class PairingCheck(Protocol):
    """An inference replica's pairing with its version's tokenizer (``version_backends.RouteChecker``)."""

    async def route(self, model: str) -> RouteInfo:
        """The checked pairing for ``model``; NOT_FOUND / FAILED_PRECONDITION / UNAVAILABLE."""
        ...

    def forget_route(self) -> None:
        """Check again on the next use."""
        ...


class TokenizerClients:
    """A tokenizer replica's unary client, shared detokenizer call and Info stub."""

    def __init__(self, channel: aio.Channel) -> None:
        self.stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        self.tokenizer = TokenizerClient(self.stub)
        self.detokenizer = DetokenizeMuxClient(self.stub)

    def reset(self) -> None:
        """Nothing is checked against a tokenizer replica itself."""

    async def close(self) -> None:
        await self.detokenizer.close()


class InferenceClients:
    """An inference replica's generations and its pairing check (``checker``, cached)."""

    def __init__(self, channel: aio.Channel, generate_mux: bool,
                 make_checker: Callable[[inference_pb2_grpc.InferenceStub], PairingCheck]) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        self.generations: GenerateMuxClient | GenerateCallClient = (
            GenerateMuxClient(stub) if generate_mux else GenerateCallClient(stub))
        self.checker = make_checker(stub)

    async def check(self, model: str) -> RouteInfo:
        """The pairing of this replica with the tokenizer (cached for ``fingerprint_ttl_s``)."""
        return await self.checker.route(model)

    def reset(self) -> None:
        """The replica (re)started: check its pairing again before it is used."""
        self.checker.forget_route()

    async def close(self) -> None:
        await self.generations.close()


class CacheClients:
    """A cache replica's client."""

    def __init__(self, channel: aio.Channel) -> None:
        self.cache = CacheClient(cache_pb2_grpc.CacheStub(channel))

    def reset(self) -> None:
        """Nothing is checked against a cache replica."""

    async def close(self) -> None:
        """The cache client shares no call: nothing to end."""
