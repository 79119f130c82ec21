"""The gateway's end of the tokenizer's DetokenizeMux: every running generation shares one call.

The edge: the ``Detokenizer`` of ``services/gateway/interfaces.py`` over gRPC (items and deltas
are pb here; the pipeline pushes token ids and gets text back).

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

from aiserve.common.errors import ApiError, DeadlineExceeded
from aiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend_errors import item_error
from services.gateway.shared_call import Reopening, SharedCall


class _Call(SharedCall[tokenizer_pb2.DetokenizeMuxItem]):
    """One DetokenizeMux call and the generations waiting on it."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self.waiting: dict[int, asyncio.Future[str]] = {}
        super().__init__("tokenizer", "detokenizer", stub.DetokenizeMux,
                         lambda items: tokenizer_pb2.DetokenizeMuxRequest(items=items))

    def on_reply(self, reply: tokenizer_pb2.DetokenizeMuxResponse) -> None:
        for delta in reply.deltas:
            future = self.waiting.pop(delta.stream, None)
            if future is None or future.done():
                continue  # its generation was cancelled meanwhile
            if delta.code:
                future.set_exception(item_error("tokenizer", delta.code, delta.message))
            else:
                future.set_result(delta.text_delta)

    def on_fail(self, error: ApiError) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error.fresh())
        self.waiting.clear()


class DetokenizeMuxClient:
    """Opens ``MuxStream``s, one per generation, over a shared DetokenizeMux call."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._calls = Reopening(lambda: _Call(stub))

    def open(self, request_id: str, skip_special_tokens: bool) -> MuxStream:
        """A new generation's stream (nothing is sent until its first ``push``)."""
        return MuxStream(*self._calls.next(), request_id, skip_special_tokens)

    async def close(self) -> None:
        await self._calls.close()


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
            current.send(tokenizer_pb2.DetokenizeMuxItem(stream=self._stream, cancel=True))

    async def _send(self, item: tokenizer_pb2.DetokenizeMuxItem, timeout_s: float) -> str:
        current = self._current
        if current.error is not None:
            raise current.error.fresh()  # the call broke: this generation's detokenizer state is gone
        if not self._started:
            item.start, item.skip_special_tokens, item.request_id = True, self._skip, self._request_id
            self._started = True
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        current.waiting[self._stream] = future
        current.send(item)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise DeadlineExceeded("tokenizer: no text for the generated ids before the deadline") from None
