"""The gateway's end of DetokenizeMux (one shared call) against a fake tokenizer over a real gRPC socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio

from aiserve.common.context import REQUEST_ID_KEY, request_id_var
from aiserve.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from aiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.detokenize_mux_client import DetokenizeMuxClient
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
BREAK, HANG = 666, 777  # ids that make the fake abort the call / never answer


@dataclass
class Seen:
    messages: list[list[tokenizer_pb2.DetokenizeMuxItem]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Answers each item with "<id>;" per id; rejects id 999 as the real one rejects bad ids."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def DetokenizeMux(self, requests, context):  # noqa: N802, ANN001, ANN201
        self.seen.calls += 1
        self.seen.metadata.append(dict(context.invocation_metadata() or ()))
        async for request in requests:
            self.seen.messages.append(list(request.items))
            ids = [t for item in request.items for t in item.token_ids]
            if BREAK in ids:
                await context.abort(grpc.StatusCode.INTERNAL, "boom")
            if HANG in ids:
                await asyncio.Event().wait()
            reply = tokenizer_pb2.DetokenizeMuxResponse()
            for item in request.items:
                if item.cancel:
                    continue
                if 999 in item.token_ids:
                    reply.deltas.add(stream=item.stream, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     message="items[0].token_ids[0]: 999 is outside [0, 999)")
                else:
                    reply.deltas.add(stream=item.stream, text_delta="".join(f"{t};" for t in item.token_ids)
                                     + ("<end>" if item.end else ""))
            yield reply


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[DetokenizeMuxClient, Seen]]:
    seen = Seen()
    async with fake_backend(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, FakeTokenizer(seen)) as channel:
        mux = DetokenizeMuxClient(tokenizer_pb2_grpc.TokenizerStub(channel))
        try:
            yield mux, seen
        finally:
            await mux.close()


async def test_concurrent_generations_share_messages_and_get_their_own_text(
        fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, seen = fake

    async def generation(n: int) -> str:
        stream = mux.open(f"r{n}", skip_special_tokens=True)
        try:
            text = "".join([await stream.push((n, step), TIMEOUT_S) for step in range(3)])
            return text + await stream.finish(TIMEOUT_S)
        finally:
            stream.close()

    texts = await asyncio.gather(*(generation(n) for n in range(32)))
    assert texts == [f"{n};0;{n};1;{n};2;<end>" for n in range(32)]
    items = [item for message in seen.messages for item in message]
    assert len(items) == 32 * 4 and seen.calls == 1
    assert len(seen.messages) < len(items) / 4  # gathered: far fewer messages than items
    starts = [item for item in items if item.start]
    assert len(starts) == 32 and all(item.skip_special_tokens and item.request_id for item in starts)


async def test_a_failed_item_fails_only_its_generation(fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, _ = fake
    good, bad = mux.open("a", True), mux.open("b", True)
    results = await asyncio.gather(good.push((1,), TIMEOUT_S), bad.push((999,), TIMEOUT_S), return_exceptions=True)
    assert results[0] == "1;"
    assert isinstance(results[1], InvalidArgument) and "999 is outside" in results[1].message
    assert await good.push((2,), TIMEOUT_S) == "2;"


async def test_a_broken_call_fails_its_generations_and_the_next_opens_a_new_one(
        fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, seen = fake
    waiting, breaking = mux.open("a", True), mux.open("b", True)
    assert await waiting.push((1,), TIMEOUT_S) == "1;"
    # both items go out in one message, so both generations are waiting when the call breaks
    errors = await asyncio.gather(waiting.push((2,), TIMEOUT_S), breaking.push((BREAK,), TIMEOUT_S),
                                  return_exceptions=True)
    for error in errors:
        assert isinstance(error, Unavailable)
        assert error.message == "tokenizer unavailable: the detokenizer call failed with INTERNAL: boom"
    assert errors[0] is not errors[1]  # one exception per generation: tracebacks are not shared
    with pytest.raises(Unavailable):  # its state died with the call
        await waiting.push((3,), TIMEOUT_S)
    fresh = mux.open("c", True)
    assert await fresh.push((3,), TIMEOUT_S) == "3;"
    assert seen.calls == 2


async def test_close_cancels_an_unfinished_stream_and_finish_without_ids_sends_nothing(
        fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, seen = fake
    idle = mux.open("idle", True)
    assert await idle.finish(TIMEOUT_S) == ""
    idle.close()
    cancelled = mux.open("x", True)
    await cancelled.push((1,), TIMEOUT_S)
    cancelled.close()
    probe = mux.open("probe", True)
    await probe.push((2,), TIMEOUT_S)  # sent after the cancel item, so the fake has seen it
    items = [item for message in seen.messages for item in message]
    assert [(i.token_ids[:], i.start, i.cancel) for i in items] == [([1], True, False), ([], False, True),
                                                                     ([2], True, False)]


async def test_no_answer_before_the_deadline_is_deadline_exceeded(fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, _ = fake
    stream = mux.open("slow", True)
    with pytest.raises(DeadlineExceeded, match="before the deadline"):
        await stream.push((HANG,), 0.2)


async def test_the_shared_call_carries_no_request_id(fake: tuple[DetokenizeMuxClient, Seen]) -> None:
    mux, seen = fake
    token = request_id_var.set("the-first-request")
    try:
        stream = mux.open("the-first-request", True)
        await stream.push((1,), TIMEOUT_S)
    finally:
        request_id_var.reset(token)
    assert REQUEST_ID_KEY not in seen.metadata[0]
