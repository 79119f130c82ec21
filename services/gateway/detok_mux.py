"""The gateway's side of the tokenizer's DetokenizeMux: every running generation shares one call.

One engine step makes a token for each running sequence, and their messages reach the gateway
within a millisecond or two. With a DetokenizeStream per generation that is two more gRPC
messages per token in the gateway and two in the tokenizer, and on a machine where the model
already uses every core, their CPU time stalls the model's threads (docs/gateway.md). Here
generations push their ids into a shared outbox; one writer task sends whatever has gathered
as one message while the previous one is on the wire, and one reader task hands each delta to
the generation waiting for it.

If the call breaks (the tokenizer restarted), every generation on it fails with UNAVAILABLE
(their detokenizer state is gone with the call) and the next generation opens a new call.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from dataclasses import dataclass, field

import grpc
from grpc import aio

from aiserve.common.errors import ApiError, DeadlineExceeded, Unavailable
from aiserve.common.logging import get_logger
from aiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backends import status_error

log = get_logger("detok_mux")


@dataclass(eq=False)
class _Call:
    """One DetokenizeMux call and the generations waiting on it."""

    call: aio.StreamStreamCall
    outbox: list[tokenizer_pb2.DetokenizeMuxItem] = field(default_factory=list)
    waiting: dict[int, asyncio.Future[str]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: ApiError | None = None
    """Why the call is over (None while it is live)."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class DetokenizeMux:
    """Opens ``MuxStream``s, one per generation, over a shared DetokenizeMux call."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._stub = stub
        self._current: _Call | None = None
        self._ids = itertools.count(1)

    def open(self, request_id: str, skip_special_tokens: bool) -> MuxStream:
        """A new generation's stream (nothing is sent until its first ``push``)."""
        return MuxStream(self._live_call(), next(self._ids), request_id, skip_special_tokens)

    async def close(self) -> None:
        if (current := self._current) is not None:
            self._current = None
            current.call.cancel()
            for task in current.tasks:
                task.cancel()
            await asyncio.gather(*current.tasks, return_exceptions=True)

    def _live_call(self) -> _Call:
        if self._current is None or self._current.error is not None:
            # A fresh context: the call and its tasks belong to no request (no request id in
            # their metadata or log lines).
            empty = contextvars.Context()
            current = _Call(empty.run(self._stub.DetokenizeMux))
            loop = asyncio.get_running_loop()
            current.tasks = [loop.create_task(self._write(current), context=empty),
                             loop.create_task(self._read(current), context=empty)]
            self._current = current
        return self._current

    async def _write(self, current: _Call) -> None:
        try:
            while True:
                await current.wake.wait()
                current.wake.clear()
                items, current.outbox = current.outbox, []
                if items:
                    await current.call.write(tokenizer_pb2.DetokenizeMuxRequest(items=items))
        except asyncio.CancelledError:
            self._fail(current, Unavailable("tokenizer unavailable: the gateway is closing"))
            raise
        except Exception as exc:  # noqa: BLE001 - a broken call (RpcError, or a write after cancel)
            self._fail(current, _broken(exc))

    async def _read(self, current: _Call) -> None:
        try:
            async for reply in current.call:
                for delta in reply.deltas:
                    future = current.waiting.pop(delta.stream, None)
                    if future is None or future.done():
                        continue  # its generation was cancelled meanwhile
                    if delta.code:
                        code = _CODES.get(delta.code, grpc.StatusCode.UNKNOWN)
                        future.set_exception(status_error("tokenizer", code, delta.message))
                    else:
                        future.set_result(delta.text_delta)
            self._fail(current, Unavailable("tokenizer unavailable: the detokenizer stream ended"))
        except asyncio.CancelledError:
            self._fail(current, Unavailable("tokenizer unavailable: the gateway is closing"))
            raise
        except Exception as exc:  # noqa: BLE001 - a broken call: nobody may be left waiting
            self._fail(current, _broken(exc))

    def _fail(self, current: _Call, error: ApiError) -> None:
        """The call is over: fail everything waiting on it; the next ``open`` starts another."""
        if current.error is None:
            current.error = error
            log.warning("detokenize_mux_failed", error=error.message, waiting=len(current.waiting))
        for future in current.waiting.values():
            if not future.done():
                future.set_exception(_fresh(error))
        current.waiting.clear()
        if self._current is current:
            current.call.cancel()
            for task in current.tasks:
                if task is not asyncio.current_task():
                    task.cancel()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _fresh(error: ApiError) -> ApiError:
    """A new instance per generation: one exception object raised in many tasks would share
    (and keep rewriting) one traceback."""
    return type(error)(error.message)


def _broken(exc: Exception) -> ApiError:
    """What the generations on a broken call see: the call's status if it is a caller's
    mistake or UNAVAILABLE, otherwise UNAVAILABLE (their detokenizer state is lost either way)."""
    if not isinstance(exc, grpc.RpcError):
        return Unavailable(f"tokenizer unavailable: the detokenizer call broke ({type(exc).__name__}: {exc})")
    code = exc.code()  # type: ignore[attr-defined]
    details = exc.details() or code.name  # type: ignore[attr-defined]
    error = status_error("tokenizer", code, details)
    if isinstance(error, ApiError):
        return error
    return Unavailable(f"tokenizer unavailable: the detokenizer call failed with {code.name}: {details}")


class MuxStream:
    """One generation's incremental detokenization over the shared call.

    ``push`` the ids of each inference message, ``finish`` once at the end for the held-back
    rest, and ``close`` always (it cancels the stream on the tokenizer when it did not finish).
    """

    def __init__(self, current: _Call, stream: int, request_id: str, skip_special_tokens: bool) -> None:
        self._current, self._stream = current, stream
        self._request_id, self._skip = request_id, skip_special_tokens
        self._started = self._ended = False

    async def push(self, token_ids: tuple[int, ...], timeout_s: float) -> str:
        """The text ``token_ids`` complete (maybe "")."""
        return await self._send(tokenizer_pb2.DetokenizeMuxItem(stream=self._stream, token_ids=token_ids),
                                timeout_s)

    async def finish(self, timeout_s: float) -> str:
        """The text still held back; the stream is closed after it."""
        self._ended = True
        if not self._started:  # nothing was generated
            return ""
        return await self._send(tokenizer_pb2.DetokenizeMuxItem(stream=self._stream, end=True), timeout_s)

    def close(self) -> None:
        """Forget the stream on the tokenizer unless it finished (no answer is awaited)."""
        current = self._current
        current.waiting.pop(self._stream, None)
        if self._started and not self._ended and current.error is None:
            self._ended = True
            current.outbox.append(tokenizer_pb2.DetokenizeMuxItem(stream=self._stream, cancel=True))
            current.wake.set()

    async def _send(self, item: tokenizer_pb2.DetokenizeMuxItem, timeout_s: float) -> str:
        current = self._current
        if current.error is not None:
            raise _fresh(current.error)  # the call broke: this generation's detokenizer state is gone
        if not self._started:
            item.start, item.skip_special_tokens, item.request_id = True, self._skip, self._request_id
            self._started = True
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        current.waiting[self._stream] = future
        current.outbox.append(item)
        current.wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise DeadlineExceeded("tokenizer: no text for the generated ids before the deadline") from None
