"""A long-lived bidirectional call that every running generation shares (docs/decisions.md,
decisions 32 and 34). The edge: this is gRPC plumbing under the two mux clients.

One engine step makes a token for each running sequence, and their messages reach the gateway
within a millisecond or two. A call per generation would cost gRPC messages per token in the
gateway and in the backend, and on a machine whose cores the model fills that CPU comes off
the model almost one for one (docs/gateway.md). Here generations put their items in a shared
outbox; one writer task sends whatever has gathered as one message while the previous one is
on the wire, and one reader task hands each answer to its generation (``on_reply``).

If the call breaks (the backend restarted), ``on_fail`` fails every generation on it (their
state on the backend is gone with the call) and the owner opens a new call for the next one.
The call is opened in a fresh context: it belongs to no request, so it carries no request id
in its metadata or log lines; each generation's first item carries its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
from grpc import aio

from aiserve.common.errors import ApiError, Unavailable
from aiserve.common.logging import get_logger
from services.gateway.backend_errors import status_error

log = get_logger("shared_call")

ItemT = TypeVar("ItemT")


class SharedCall(ABC, Generic[ItemT]):
    """The call, its outbox and its two tasks; subclasses say what a reply and a failure mean."""

    def __init__(self, service: str, what: str, open_call: Callable[[], aio.StreamStreamCall],
                 batch: Callable[[list[ItemT]], Any]) -> None:
        self.service, self.what = service, what  # what: "detokenizer", for "the detokenizer call"
        self._batch = batch
        self.outbox: list[ItemT] = []
        self.error: ApiError | None = None
        """Why the call is over (None while it is live)."""
        self._wake = asyncio.Event()
        empty = contextvars.Context()
        self.call = empty.run(open_call)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(), context=empty),
                       loop.create_task(self._read(), context=empty)]

    @abstractmethod
    def on_reply(self, reply: Any) -> None:
        """Hand a reply's parts to their generations."""

    @abstractmethod
    def on_fail(self, error: ApiError) -> None:
        """Fail every generation still waiting on the call (a fresh exception each: ``ApiError.fresh``)."""

    def send(self, item: ItemT) -> None:
        """Queue ``item`` for the next message (the caller checks ``error`` first)."""
        self.outbox.append(item)
        self._wake.set()

    async def close(self) -> None:
        self.fail(Unavailable(f"{self.service} unavailable: the gateway is closing"))
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def fail(self, error: ApiError) -> None:
        """The call is over: fail everything waiting on it; the owner starts another."""
        if self.error is None:
            self.error = error
            log.warning("shared_call_failed", call=self.what, error=error.message)
        self.on_fail(error)
        self.call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                items, self.outbox = self.outbox, []
                if items:
                    await self.call.write(self._batch(items))
        except asyncio.CancelledError:
            self.fail(Unavailable(f"{self.service} unavailable: the gateway is closing"))
            raise
        except Exception as exc:  # noqa: BLE001 - a broken call (RpcError, or a write after cancel)
            self.fail(self._broken(exc))

    async def _read(self) -> None:
        try:
            async for reply in self.call:
                self.on_reply(reply)
            self.fail(Unavailable(f"{self.service} unavailable: the {self.what} stream ended"))
        except asyncio.CancelledError:
            self.fail(Unavailable(f"{self.service} unavailable: the gateway is closing"))
            raise
        except Exception as exc:  # noqa: BLE001 - a broken call: nobody may be left waiting
            self.fail(self._broken(exc))

    def _broken(self, exc: Exception) -> ApiError:
        """What the generations on a broken call see: the call's status if it is a caller's
        mistake or UNAVAILABLE, otherwise UNAVAILABLE (their backend state is lost either way)."""
        if not isinstance(exc, grpc.RpcError):
            return Unavailable(f"{self.service} unavailable: the {self.what} call broke ({type(exc).__name__}: {exc})")
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() or code.name  # type: ignore[attr-defined]
        error = status_error(self.service, code, details)
        if isinstance(error, ApiError):
            return error
        return Unavailable(f"{self.service} unavailable: the {self.what} call failed with {code.name}: {details}")


CallT = TypeVar("CallT", bound="SharedCall[Any]")


class Reopening(Generic[CallT]):
    """An owner's current shared call, opened on first use and again once it broke, and the
    numbers of the generations put on it (unique for the owner's life)."""

    def __init__(self, open_call: Callable[[], CallT]) -> None:
        self._open_call = open_call
        self._current: CallT | None = None
        self._ids = itertools.count(1)

    def next(self) -> tuple[CallT, int]:
        """The live call and a new generation's number on it."""
        if self._current is None or self._current.error is not None:
            self._current = self._open_call()
        return self._current, next(self._ids)

    async def close(self) -> None:
        if (current := self._current) is not None:
            self._current = None
            await current.close()

