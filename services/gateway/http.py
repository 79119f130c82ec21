"""The OpenAI-compatible HTTP door of the gateway (docs/http.md).

A Starlette app served by uvicorn on the gateway's own event loop, beside its gRPC server: the
same process, no extra hop. Each chat or completions request is checked and converted
(``openai_request.py``), runs through ``GatewayServicer.responses`` (the very code of the gRPC
Generate: keys, tenants, limits, priorities, cache, ledger, request ids) once per choice, and
its messages are converted back (``openai_response.py``), whole or as server-sent events.
Errors take OpenAI's shape with the HTTP status of their gRPC code (``http_errors.py``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aiserve.common.context import (
    REQUEST_ID_KEY,
    SESSION_KEY,
    TRACEPARENT_KEY,
    is_valid_request_id,
    mint_request_id,
    request_id_var,
    traceparent_var,
)
from aiserve.common.errors import InvalidArgument
from aiserve.common.logging import get_logger
from aiserve.common.server import ServiceHandle
from aiserve.v1 import common_pb2, gateway_pb2
from services.gateway.backends import Backends
from services.gateway.config import GatewayConfig
from services.gateway.domain import CallInfo
from services.gateway.http_errors import PayloadTooLarge, error_event, error_response, response_of
from services.gateway.openai_request import (
    OpenAIRequest,
    cache_policy,
    chat_request,
    completion_request,
    parse_body,
)
from services.gateway.openai_response import Choice, ChunkWriter, chat_completion, text_completion

if TYPE_CHECKING:  # the servicer imports this module to serve it
    from services.gateway.server import GatewayServicer

log = get_logger("http")

Models = Callable[[], Sequence[str]]
"""Every model a request may name: the routes and their versions ("name", "name@version")."""
Health = Callable[[], tuple[bool, str]]
"""The gateway's health: (serving, reason when not)."""
_Tagged = tuple[int, gateway_pb2.GenerateResponse]
_Replies = AsyncGenerator[gateway_pb2.GenerateResponse, None]
_DONE = b"data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class HttpDoor:
    """The routes of the HTTP API over one gateway servicer."""

    def __init__(self, config: GatewayConfig, servicer: GatewayServicer, models: Models, health: Health) -> None:
        self.config, self.servicer, self.models, self.health = config, servicer, models, health
        self.app = Starlette(routes=[
            Route("/health", self.get_health, methods=["GET"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ], exception_handlers={404: self.not_found, 405: self.not_allowed})

    # --- plain routes ---------------------------------------------------------------------------

    async def get_health(self, request: Request) -> Response:
        is_serving, reason = self.health()
        if is_serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not_serving", "reason": reason}, status_code=503)

    async def list_models(self, request: Request) -> Response:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "aiserve"} for model in self.models()]})

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(404, "not_found_error", f"{request.url.path}: no such endpoint (aiserve serves "
                              "/v1/models, /v1/chat/completions, /v1/completions and /health)", None, "not_found",
                              _request_id(request))

    async def not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(405, "invalid_request_error", f"{request.method} {request.url.path}: method not "
                              "allowed", None, "method_not_allowed", _request_id(request))

    # --- generations ------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, is_chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, is_chat=False)

    async def _generate(self, request: Request, is_chat: bool) -> Response:
        request_id = _request_id(request)
        request_id_var.set(request_id)
        traceparent_var.set(request.headers.get(TRACEPARENT_KEY, "")[:256])
        started = time.perf_counter()
        response = await self._answer(request, request_id, is_chat)
        log.info("http", path=request.url.path, status=response.status_code,  # for a stream: its first token
                 latency_ms=round((time.perf_counter() - started) * 1000, 2))
        return response

    async def _answer(self, request: Request, request_id: str, is_chat: bool) -> Response:
        try:
            if request.headers.get(REQUEST_ID_KEY) not in (None, request_id):
                raise InvalidArgument(f"{REQUEST_ID_KEY}: must be 1-128 printable ASCII characters")
            body = parse_body(await self._body(request))
            parse = chat_request if is_chat else completion_request
            asked = parse(body, self.config.http_max_choices)
            asked.request.cache = cache_policy(request.headers.get("cache-control", ""))
            call = CallInfo(request.headers.get("authorization", ""), request.headers.get(SESSION_KEY, ""),
                            None, asked.user)
            if asked.stream:
                return await self._stream(asked, call, request_id)
            return await self._whole(asked, call, request_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error, never a crash
            return response_of(exc, request_id, is_chat)

    async def _body(self, request: Request) -> bytes:
        """The body, refused before it is read when it is not JSON or is over the limit."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise InvalidArgument(f"content-type: must be application/json, got {kind or 'none'!r}")
        limit = self.config.http_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"body: at most {limit} bytes, got {declared}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise PayloadTooLarge(f"body: at most {limit} bytes")
        return bytes(body)

    def _choices(self, asked: OpenAIRequest, call: CallInfo) -> AsyncGenerator[_Tagged, None]:
        """Every choice's messages, tagged with its index (one choice: no merging)."""
        api = "Generate" if asked.stream else "Complete"
        if asked.n == 1:
            return _tag(0, self.servicer.responses(api, asked.request, call))
        return _merge([self.servicer.responses(api, asked.choice(i), call) for i in range(asked.n)])

    async def _whole(self, asked: OpenAIRequest, call: CallInfo, request_id: str) -> Response:
        choices = [Choice(i) for i in range(asked.n)]
        async with aclosing(self._choices(asked, call)) as replies:
            async for index, reply in replies:
                choices[index].add(reply)
        build = chat_completion if asked.is_chat else text_completion
        body = build(request_id, int(time.time()), choices, asked.top_logprobs is not None)
        return JSONResponse(body, headers={REQUEST_ID_KEY: request_id})

    async def _stream(self, asked: OpenAIRequest, call: CallInfo, request_id: str) -> Response:
        """Server-sent events. The first message is awaited before the answer starts, so that a
        refusal (key, limits, validation, routing) is an HTTP status, not an event."""
        replies = self._choices(asked, call)
        try:
            first = await anext(replies)
        except BaseException:
            await replies.aclose()
            raise
        writer = ChunkWriter(request_id, int(time.time()), asked.model or self.config.default_model,
                             asked.is_chat, asked.top_logprobs is not None, asked.include_usage)
        events = self._events(writer, asked, first, replies)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={REQUEST_ID_KEY: request_id, "cache-control": "no-cache"})

    async def _events(self, writer: ChunkWriter, asked: OpenAIRequest, first: _Tagged,
                      rest: AsyncGenerator[_Tagged, None]) -> AsyncGenerator[bytes, None]:
        usages: list[common_pb2.Usage] = []
        if asked.is_chat:
            for index in range(asked.n):
                yield _sse(writer.opening(index))
        try:
            async with aclosing(_prepend(first, rest)) as replies:
                async for index, reply in replies:
                    if reply.HasField("usage"):
                        usages.append(reply.usage)
                    if (chunk := writer.reply(index, reply)) is not None:
                        yield _sse(chunk)
        except Exception as exc:  # noqa: BLE001 - after the headers an error can only be an event
            yield error_event(exc, request_id_var.get(), asked.is_chat)
            return
        if asked.include_usage:
            yield _sse(writer.usage_chunk(usages))
        yield _DONE


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_KEY, "")
    return given if given and is_valid_request_id(given) else mint_request_id()


async def _tag(index: int, replies: _Replies) -> AsyncGenerator[_Tagged, None]:
    async with aclosing(replies):
        async for reply in replies:
            yield index, reply


async def _prepend(first: _Tagged, rest: AsyncGenerator[_Tagged, None]) -> AsyncGenerator[_Tagged, None]:
    yield first
    async with aclosing(rest):
        async for item in rest:
            yield item


async def _merge(streams: Sequence[_Replies]) -> AsyncGenerator[_Tagged, None]:
    """The messages of several generations as they come, each tagged with its index; the first
    failure cancels the others and is raised."""
    queue: asyncio.Queue[_Tagged | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: _Replies) -> None:
        try:
            async with aclosing(_tag(index, stream)) as tagged:
                async for item in tagged:
                    await queue.put(item)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def add_http(handle: ServiceHandle, config: GatewayConfig, servicer: GatewayServicer, backends: Backends) -> None:
    """Serve the door in the gateway's process: bound now, started with the gRPC server,
    stopped before the ledger and the backends close."""

    def models() -> list[str]:
        table = backends.routes.table
        return [name for route in table.routes.values() for name in (route.name, *(v.model for v in route.versions))]

    door = HttpDoor(config, servicer, models, lambda: (handle.is_serving, handle.reason))
    http = HttpServer(door, config.host, config.http_port, config.grace_s)
    handle.extra_ports = (http.port,)
    handle.on_start.append(http.start)
    handle.on_stopping.append(http.stopping)
    handle.on_close.append(http.close)  # on_close runs in reverse: the HTTP requests end first


class HttpServer:
    """uvicorn serving the door on the gateway's loop, on a socket bound up front (so that port
    -1 can be announced). uvicorn's ``serve`` is not used: it takes over SIGTERM and SIGINT,
    which belong to the gateway's own graceful stop; its steps are called here instead."""

    def __init__(self, door: HttpDoor, host: str, port: int, grace_s: float) -> None:
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, max(port, 0)))
        except OSError as exc:
            self.socket.close()
            raise OSError(f"gateway: cannot bind the HTTP port {host}:{port}: {exc}") from exc
        self.port: int = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            door.app, log_config=None, access_log=False, lifespan="off", http="h11", ws="none",
            timeout_graceful_shutdown=max(int(grace_s), 1)))
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Begin accepting (returns once it listens)."""
        config = self.server.config
        if not config.loaded:
            config.load()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup(sockets=[self.socket])
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("http_serving", port=self.port)

    async def _run(self) -> None:
        await self.server.main_loop()  # until should_exit
        await self.server.shutdown(sockets=[self.socket])  # connections get timeout_graceful_shutdown

    def stopping(self) -> None:
        """Take no new connections; the requests in flight go on (up to the grace period)."""
        self.server.should_exit = True

    async def close(self) -> None:
        """Wait for the requests in flight (uvicorn cancels them after the grace period)."""
        self.stopping()
        if self._task is not None:
            await self._task
        self.socket.close()
        log.info("http_stopped", port=self.port)
