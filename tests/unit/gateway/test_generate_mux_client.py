"""The gateway's end of GenerateMux (one shared call) against a fake inference service over a real
gRPC socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio

from aiserve.common.context import REQUEST_ID_KEY, request_id_var
from aiserve.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from aiserve.common.finish import FinishReason
from aiserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.gateway.domain import GenerationEvent, GenerationRequest
from services.gateway.generate_mux_client import GenerateMuxClient, MuxGeneration
from services.gateway.validation import Sampling
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
# prompts the fake reads as instructions
BAD, BREAK, HANG = [999], [666], [777]  # an INVALID_ARGUMENT event / abort the call / no answer


@dataclass
class Seen:
    messages: list[list[inference_pb2.GenerateMuxItem]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Answers a start item with max_new_tokens messages, ids 100*p+i for a prompt ending in p,
    all in one reply; the last carries finish_reason LENGTH and the counters."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def GenerateMux(self, requests, context):  # noqa: N802, ANN001, ANN201
        self.seen.calls += 1
        self.seen.metadata.append(dict(context.invocation_metadata() or ()))
        async for request in requests:
            self.seen.messages.append(list(request.items))
            reply = inference_pb2.GenerateMuxResponse()
            for item in request.items:
                if item.cancel:
                    continue
                prompt = list(item.request.prompt_token_ids)
                if prompt == BREAK:
                    await context.abort(grpc.StatusCode.INTERNAL, "boom")
                if prompt == HANG:
                    continue
                if prompt == BAD:
                    reply.events.add(stream=item.stream, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     message="prompt_token_ids: id 999 is outside the vocabulary 0..99")
                    continue
                n = item.request.decoding.max_new_tokens
                for i in range(n):
                    last = i == n - 1
                    reply.events.add(stream=item.stream, response=inference_pb2.InferenceResponse(
                        request_id=item.request.request_id, token_ids=[100 * prompt[-1] + i], completion_tokens=i + 1,
                        finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                        queue_ms=7 if last else 0, compute_ms=40 if last else 0, kv_peak_bytes=4096 if last else 0))
            yield reply


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[GenerateMuxClient, Seen]]:
    seen = Seen()
    async with fake_backend(inference_pb2_grpc.add_InferenceServicer_to_server, FakeInference(seen)) as channel:
        mux = GenerateMuxClient(inference_pb2_grpc.InferenceStub(channel))
        try:
            yield mux, seen
        finally:
            await mux.close()


def request(prompt: list[int], max_new_tokens: int = 3, request_id: str = "r") -> GenerationRequest:
    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                        stop=(), seed=None)
    return GenerationRequest(request_id, "m@1", tuple(prompt), sampling, priority=0)


async def read_all(generation: MuxGeneration) -> list[GenerationEvent]:
    events = [await generation.read(TIMEOUT_S)]
    while events[-1].finish_reason is None:
        events.append(await generation.read(TIMEOUT_S))
    return events


async def test_concurrent_generations_share_the_call_and_get_their_own_messages(
        fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, seen = fake

    async def generation(n: int) -> list[tuple[int, ...]]:
        g = mux.open(request([1, n], max_new_tokens=n % 4 + 1, request_id=f"r{n}"), TIMEOUT_S)
        try:
            return [event.token_ids for event in await read_all(g)]
        finally:
            g.close()

    results = await asyncio.gather(*(generation(n) for n in range(32)))
    assert results == [[(100 * n + i,) for i in range(n % 4 + 1)] for n in range(32)]
    items = [item for message in seen.messages for item in message]
    assert len(items) == 32 and seen.calls == 1  # no cancel items: every generation ended
    assert sorted(item.request.request_id for item in items) == sorted(f"r{n}" for n in range(32))
    assert len(seen.messages) < len(items) / 4  # gathered: far fewer messages than generations
    assert all(0 < item.timeout_ms <= TIMEOUT_S * 1000 for item in items)  # each carries its deadline


async def test_a_failed_generation_fails_alone(fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, _ = fake
    good, bad = mux.open(request([1]), TIMEOUT_S), mux.open(request(BAD), TIMEOUT_S)
    with pytest.raises(InvalidArgument, match="prompt_token_ids: id 999 is outside"):
        await bad.read(TIMEOUT_S)
    events = await read_all(good)
    assert [e.token_ids for e in events] == [(100,), (101,), (102,)]
    # the last event carries the finish reason and the counters, as domain values
    assert events[-1] == GenerationEvent((102,), FinishReason.LENGTH, queue_ms=7, compute_ms=40, kv_peak_bytes=4096)
    assert [e.finish_reason for e in events[:-1]] == [None, None]


async def test_a_broken_call_fails_its_generations_and_the_next_opens_a_new_one(
        fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, seen = fake
    waiting = mux.open(request(HANG), TIMEOUT_S)  # never answered
    breaking = mux.open(request(BREAK), TIMEOUT_S)
    errors = []
    for generation in (breaking, waiting):  # the waiting one's state died with the call
        with pytest.raises(Unavailable, match="inference unavailable: the generation call failed with INTERNAL: boom") \
                as info:
            await generation.read(TIMEOUT_S)
        errors.append(info.value)
    assert errors[0] is not errors[1]  # one exception per generation: tracebacks are not shared
    assert [e.token_ids for e in await read_all(mux.open(request([1], 1), TIMEOUT_S))] == [(100,)]
    assert seen.calls == 2


async def test_close_cancels_an_unfinished_generation_only(fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, seen = fake
    finished = mux.open(request([1], 1), TIMEOUT_S)
    await read_all(finished)
    finished.close()  # ended: nothing to cancel
    hanging = mux.open(request(HANG), TIMEOUT_S)
    hanging.close()
    probe = mux.open(request([2], 1), TIMEOUT_S)
    await read_all(probe)  # sent after the cancel item, so the fake has seen it
    items = [item for message in seen.messages for item in message]
    assert [(item.stream, item.cancel) for item in items] == [(1, False), (2, False), (2, True), (3, False)]


async def test_no_message_before_the_deadline_is_deadline_exceeded(fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, _ = fake
    generation = mux.open(request(HANG), 0.2)
    with pytest.raises(DeadlineExceeded, match="no token before the deadline"):
        await generation.read(0.2)


async def test_the_shared_call_carries_no_request_id(fake: tuple[GenerateMuxClient, Seen]) -> None:
    mux, seen = fake
    token = request_id_var.set("the-first-request")
    try:
        await read_all(mux.open(request([1], 1, "the-first-request"), TIMEOUT_S))
    finally:
        request_id_var.reset(token)
    assert REQUEST_ID_KEY not in seen.metadata[0]
    assert seen.messages[0][0].request.request_id == "the-first-request"  # it travels in the item
