"""The pairing check against fake tokenizer and inference services over real gRPC sockets, the
mapping of a backend's status to what the caller sees, and the adapters the gateway builds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio

from aiserve.common.errors import (
    ApiError,
    DeadlineExceeded,
    ErrorKind,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from aiserve.v1 import inference_pb2, inference_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway import version_backends as backends_module
from services.gateway.backend_errors import downstream_error, item_error, status_error
from services.gateway.backends import Backends
from services.gateway.config import GatewayConfig
from services.gateway.domain import RouteInfo
from services.gateway.generate_call_client import GenerateCallClient
from services.gateway.generate_mux_client import GenerateMuxClient
from services.gateway.routing import Routes
from services.gateway.version_backends import RouteChecker
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
MODEL = "m@1"


@dataclass
class Served:
    """What each fake says it serves; ``hang`` / ``code`` make its Info never answer / fail."""

    model: str = MODEL
    sha256: str = "abc123"
    hang: bool = False
    code: grpc.StatusCode | None = None
    calls: int = 0


@dataclass
class Fleet:
    tokenizer: Served = field(default_factory=Served)
    inference: Served = field(default_factory=Served)


async def _info(served: Served, context: grpc.aio.ServicerContext) -> None:
    served.calls += 1
    if served.hang:
        await asyncio.Event().wait()
    if served.code is not None:
        await context.abort(served.code, "info refused")


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, served: Served) -> None:
        self.served = served

    async def Info(self, request, context):  # noqa: N802, ANN001, ANN201
        await _info(self.served, context)
        return tokenizer_pb2.TokenizerInfo(model=self.served.model, tokenizer_sha256=self.served.sha256)


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, served: Served) -> None:
        self.served = served

    async def Info(self, request, context):  # noqa: N802, ANN001, ANN201
        await _info(self.served, context)
        return inference_pb2.InferenceInfo(model=self.served.model, tokenizer_sha256=self.served.sha256,
                                           context_length=2048)


@pytest_asyncio.fixture
async def routes() -> AsyncIterator[tuple[RouteChecker, Fleet]]:
    fleet = Fleet()
    async with AsyncExitStack() as stack:
        tok = await stack.enter_async_context(
            fake_backend(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, FakeTokenizer(fleet.tokenizer)))
        inf = await stack.enter_async_context(
            fake_backend(inference_pb2_grpc.add_InferenceServicer_to_server, FakeInference(fleet.inference)))
        config = GatewayConfig(default_model=MODEL, fingerprint_ttl_s=600.0)
        yield RouteChecker(config, tokenizer_pb2_grpc.TokenizerStub(tok), inference_pb2_grpc.InferenceStub(inf)), fleet


async def route(checker: RouteChecker, model: str = "") -> RouteInfo:
    return await asyncio.wait_for(checker.route(model), TIMEOUT_S)


async def test_a_paired_route_is_checked_once_until_forgotten(routes: tuple[RouteChecker, Fleet]) -> None:
    checker, fleet = routes
    assert await route(checker) == RouteInfo(MODEL, 2048)
    assert await route(checker, MODEL) == RouteInfo(MODEL, 2048)  # within the ttl: not asked again
    assert (fleet.tokenizer.calls, fleet.inference.calls) == (1, 1)
    checker.forget_route()
    await route(checker)
    assert (fleet.tokenizer.calls, fleet.inference.calls) == (2, 2)


async def test_a_model_that_is_not_served_is_not_found(routes: tuple[RouteChecker, Fleet]) -> None:
    checker, fleet = routes
    with pytest.raises(NotFound, match="'other@2' is not served; available: m@1"):
        await route(checker, "other@2")
    assert fleet.inference.calls == 0  # refused without asking anyone
    fleet.inference.model = fleet.tokenizer.model = "m@0"  # a deployment that loaded another version
    with pytest.raises(NotFound, match="is not loaded by inference"):
        await route(checker)


@pytest.mark.parametrize("mismatch", ["model", "sha256"])
async def test_a_tokenizer_that_does_not_match_the_model_is_refused(routes: tuple[RouteChecker, Fleet],
                                                                    mismatch: str) -> None:
    checker, fleet = routes
    setattr(fleet.tokenizer, mismatch, "m@9" if mismatch == "model" else "fff000")
    with pytest.raises(FailedPrecondition, match="refusing to pair them"):
        await route(checker)
    with pytest.raises(FailedPrecondition):  # never cached: asked again, refused again
        await route(checker)
    assert fleet.inference.calls == 2


async def test_a_backend_that_does_not_answer_is_unavailable(routes: tuple[RouteChecker, Fleet],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    checker, fleet = routes
    monkeypatch.setattr(backends_module, "INFO_TIMEOUT_S", 0.2)  # it never answers: any deadline passes
    fleet.inference.hang = True
    with pytest.raises(Unavailable, match="did not answer"):
        await route(checker)
    fleet.inference.hang = False
    assert (await route(checker)).model == MODEL  # a failed check is not remembered


async def test_an_info_call_that_fails_keeps_its_meaning(routes: tuple[RouteChecker, Fleet]) -> None:
    checker, fleet = routes
    fleet.tokenizer.code = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Unavailable):
        await route(checker)
    fleet.tokenizer.code = grpc.StatusCode.PERMISSION_DENIED  # not a caller's mistake: a bug (INTERNAL)
    with pytest.raises(RuntimeError, match="backend failed with PERMISSION_DENIED: info refused"):
        await route(checker)


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_callers_mistake_or_limit_passes_through_with_its_message(code: grpc.StatusCode) -> None:
    error = status_error("inference", code, "prompt_token_ids: too long")
    assert isinstance(error, ApiError)
    assert (error.kind, error.message) == (ErrorKind[code.name], "prompt_token_ids: too long")
    again = item_error("inference", code.value[0], "prompt_token_ids: too long")  # a shared call's per-item code
    assert isinstance(again, ApiError) and again.kind == error.kind


def test_an_unreachable_backend_is_unavailable_and_anything_else_is_a_bug() -> None:
    error = status_error("tokenizer", grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert isinstance(error, Unavailable) and error.message == "tokenizer unavailable: connection refused"
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED):
        bug = status_error("tokenizer", code, "boom")
        assert type(bug) is RuntimeError and str(bug) == f"tokenizer failed with {code.name}: boom"
    assert type(item_error("tokenizer", 999, "?")) is RuntimeError  # a number gRPC does not know


def test_downstream_error_returns_an_api_error_and_raises_a_bug() -> None:
    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

    assert isinstance(downstream_error("inference", Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "")), DeadlineExceeded)
    with pytest.raises(RuntimeError, match="inference failed with DATA_LOSS: DATA_LOSS"):
        downstream_error("inference", Failed(grpc.StatusCode.DATA_LOSS, ""))  # no details: the code's name


@pytest.mark.parametrize("generate_mux", [True, False])
async def test_the_gateway_builds_one_adapter_per_backend(generate_mux: bool) -> None:
    config = GatewayConfig(generate_mux=generate_mux, cache_address="",
                           inference_address="ipv4:127.0.0.1:1,127.0.0.1:2")
    built = Backends(config)
    try:
        inference = list(built.inference.replicas)
        assert [r.address for r in inference] == ["127.0.0.1:1", "127.0.0.1:2"]
        for replica in inference:  # each replica its own generations and its own pairing check
            assert isinstance(replica.clients.generations, GenerateMuxClient if generate_mux else GenerateCallClient)
            assert isinstance(replica.clients.checker, RouteChecker)
        assert len({id(r.clients.generations) for r in inference}) == 2
        assert [r.address for r in built.tokenizers.replicas] == ["127.0.0.1:50052"]
        assert built.pipeline.cache is None  # no cache address: caching is off
        assert isinstance(built.pipeline.router, Routes)
    finally:
        await built.close()
