"""What both shared calls have in common, on a minimal subclass over a real gRPC socket: how a
call that breaks, ends or closes fails the generations waiting on it, and that the owner then
opens a new one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from aiserve.common.errors import ApiError, InvalidArgument, Unavailable
from aiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.shared_call import Reopening, SharedCall
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0
BREAK, BAD, END, HANG = 666, 555, 444, 777  # ids that make the fake abort / refuse the call / end it / wait


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Echoes each item's ids as text; the ids above end the whole call their way."""

    def __init__(self) -> None:
        self.calls = 0

    async def DetokenizeMux(self, requests, context):  # noqa: N802, ANN001, ANN201
        self.calls += 1
        async for request in requests:
            ids = [t for item in request.items for t in item.token_ids]
            if BREAK in ids:
                await context.abort(grpc.StatusCode.INTERNAL, "boom")
            if BAD in ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "items[0]: bad")
            if END in ids:
                return
            yield tokenizer_pb2.DetokenizeMuxResponse(deltas=[
                tokenizer_pb2.DetokenizeMuxDelta(stream=i.stream, text_delta=str(list(i.token_ids)))
                for i in request.items if HANG not in i.token_ids])


class EchoCall(SharedCall[tokenizer_pb2.DetokenizeMuxItem]):
    """A generation's future per stream number (the two real subclasses, and that each fails
    its generations with a fresh exception, are tested in test_*_mux_client.py)."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self.waiting: dict[int, asyncio.Future[str]] = {}
        super().__init__("tokenizer", "echo", stub.DetokenizeMux,
                         lambda items: tokenizer_pb2.DetokenizeMuxRequest(items=items))

    def on_reply(self, reply: Any) -> None:
        for delta in reply.deltas:
            self.waiting.pop(delta.stream).set_result(delta.text_delta)

    def on_fail(self, error: ApiError) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error.fresh())
        self.waiting.clear()

    def ask(self, stream: int, *ids: int) -> asyncio.Future[str]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting[stream] = future
        self.send(tokenizer_pb2.DetokenizeMuxItem(stream=stream, token_ids=ids))
        return future


@pytest_asyncio.fixture
async def calls() -> AsyncIterator[tuple[Reopening[EchoCall], FakeTokenizer]]:
    fake = FakeTokenizer()
    async with fake_backend(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, fake) as channel:
        owner = Reopening(lambda: EchoCall(tokenizer_pb2_grpc.TokenizerStub(channel)))
        try:
            yield owner, fake
        finally:
            await owner.close()


async def outcome(future: asyncio.Future[str]) -> str | BaseException:
    try:
        return await asyncio.wait_for(future, TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the failure is what is tested
        return exc


async def test_generations_on_one_call_get_their_own_answers(calls: tuple[Reopening[EchoCall], Any]) -> None:
    owner, fake = calls
    (call, a), (same, b) = owner.next(), owner.next()
    assert call is same  # one call
    assert (a, b) == (1, 2)  # generations numbered for the owner's life
    answers = await asyncio.gather(outcome(call.ask(a, 1, 2)), outcome(call.ask(b, 3)))
    assert list(answers) == ["[1, 2]", "[3]"] and fake.calls == 1


async def test_a_broken_call_fails_every_waiting_generation_with_unavailable(
        calls: tuple[Reopening[EchoCall], FakeTokenizer]) -> None:
    owner, fake = calls
    call, first = owner.next()
    _, second = owner.next()
    waiting = call.ask(first, HANG)  # never answered: only the break can end it
    breaking = call.ask(second, BREAK)
    errors = [await outcome(waiting), await outcome(breaking)]
    for error in errors:
        assert isinstance(error, Unavailable)
        assert error.message == "tokenizer unavailable: the echo call failed with INTERNAL: boom"
    assert isinstance(call.error, Unavailable)
    fresh, number = owner.next()
    assert fresh is not call and number == 3
    assert await outcome(fresh.ask(number, 5)) == "[5]"
    assert fake.calls == 2


async def test_a_call_refused_as_a_callers_mistake_keeps_its_code(calls: tuple[Reopening[EchoCall], Any]) -> None:
    owner, _ = calls
    call, stream = owner.next()
    error = await outcome(call.ask(stream, BAD))
    assert isinstance(error, InvalidArgument) and error.message == "items[0]: bad"


async def test_a_call_the_backend_ends_fails_what_is_waiting(calls: tuple[Reopening[EchoCall], Any]) -> None:
    owner, _ = calls
    call, stream = owner.next()
    error = await outcome(call.ask(stream, END))
    assert isinstance(error, Unavailable) and error.message == "tokenizer unavailable: the echo stream ended"
    assert owner.next()[0] is not call


async def test_closing_fails_what_is_waiting_and_stops_both_tasks(calls: tuple[Reopening[EchoCall], Any]) -> None:
    owner, _ = calls
    call, stream = owner.next()
    waiting = call.ask(stream, HANG)
    assert await outcome(call.ask(owner.next()[1], 1)) == "[1]"  # the call is up
    await asyncio.wait_for(owner.close(), TIMEOUT_S)
    error = await outcome(waiting)
    assert isinstance(error, Unavailable) and "the gateway is closing" in error.message
    assert all(task.done() for task in call._tasks)
    assert call.call.cancelled() or call.call.done()


@pytest.mark.parametrize("ids", [(BREAK,), (END,)])
async def test_a_generation_sent_after_the_break_goes_on_a_new_call(calls: tuple[Reopening[EchoCall], Any],
                                                                    ids: tuple[int, ...]) -> None:
    owner, fake = calls
    call, stream = owner.next()
    await outcome(call.ask(stream, *ids))
    assert call.error is not None
    call2, stream2 = owner.next()
    assert await outcome(call2.ask(stream2, 9)) == "[9]" and fake.calls == 2
