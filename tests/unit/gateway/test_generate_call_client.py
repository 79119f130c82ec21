"""A Generate call per generation (generate_mux = false) against a fake inference service over a
real gRPC socket: the same events and errors as over the shared call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from aiserve.common.errors import InvalidArgument, Unavailable
from aiserve.common.finish import FinishReason
from aiserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.gateway.domain import GenerationEvent, GenerationRequest
from services.gateway.generate_call_client import GenerateCallClient
from services.gateway.validation import Sampling
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
BAD, SHORT, HANG = 999, 555, 777  # prompts the fake refuses / ends without a finish / never answers


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        prompt = list(request.prompt_token_ids)
        if prompt == [BAD]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: id 999 is outside")
        yield inference_pb2.InferenceResponse(token_ids=[100])
        if prompt == [SHORT]:
            return
        if prompt == [HANG]:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        yield inference_pb2.InferenceResponse(token_ids=[101], finish_reason=common_pb2.FINISH_REASON_STOP,
                                              compute_ms=12)


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[GenerateCallClient, FakeInference]]:
    servicer = FakeInference()
    async with fake_backend(inference_pb2_grpc.add_InferenceServicer_to_server, servicer) as channel:
        client = GenerateCallClient(inference_pb2_grpc.InferenceStub(channel))
        yield client, servicer
        await client.close()


def request(*prompt: int) -> GenerationRequest:
    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=2, stop=(),
                        seed=None)
    return GenerationRequest("rid", "m@1", prompt, sampling, priority=0)


async def test_a_generation_reads_its_events(fake: tuple[GenerateCallClient, FakeInference]) -> None:
    client, _ = fake
    generation = client.open(request(1), TIMEOUT_S)
    try:
        assert await generation.read(TIMEOUT_S) == GenerationEvent((100,), None)
        assert await generation.read(TIMEOUT_S) == GenerationEvent((101,), FinishReason.STOP, compute_ms=12)
    finally:
        generation.close()


async def test_errors_are_those_of_the_shared_call(fake: tuple[GenerateCallClient, FakeInference]) -> None:
    client, _ = fake
    refused = client.open(request(BAD), TIMEOUT_S)
    with pytest.raises(InvalidArgument, match="id 999 is outside"):
        await refused.read(TIMEOUT_S)
    short = client.open(request(SHORT), TIMEOUT_S)
    await short.read(TIMEOUT_S)
    with pytest.raises(Unavailable, match="ended without a finish_reason"):
        await short.read(TIMEOUT_S)


async def test_close_cancels_the_call(fake: tuple[GenerateCallClient, FakeInference]) -> None:
    client, servicer = fake
    generation = client.open(request(HANG), TIMEOUT_S)
    await generation.read(TIMEOUT_S)
    generation.close()
    await asyncio.wait_for(servicer.cancelled.wait(), TIMEOUT_S)
