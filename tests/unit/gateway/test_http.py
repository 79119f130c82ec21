"""The HTTP door's own behaviour on a real socket, over a servicer that answers what each test
needs: the status of every gRPC error code, Retry-After, a 500 with the request id, an error
after the stream began, health, and the graceful stop. The openai client is the caller."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from aiserve.common.context import current_request_id
from aiserve.common.errors import (
    ApiError,
    FailedPrecondition,
    Internal,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from aiserve.v1 import common_pb2, gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.domain import CallInfo
from services.gateway.http import HttpDoor, HttpServer

TIMEOUT_S = 30


class Scripted:
    """A servicer whose generations fail with ``error`` after ``chunks`` text deltas (None: finish)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.chunks = 2
        self.gate: asyncio.Event | None = None
        """Set: the last message waits for it."""
        self.calls: list[tuple[str, gateway_pb2.GenerateRequest, CallInfo]] = []

    async def responses(self, api: str, request: gateway_pb2.GenerateRequest,
                        call: CallInfo) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        self.calls.append((api, request, call))
        for i in range(self.chunks):
            yield gateway_pb2.GenerateResponse(request_id=current_request_id(), text_delta=f"w{i} ", token_ids=[i])
        if self.error is not None:
            raise self.error
        if self.gate is not None:
            await self.gate.wait()
        yield gateway_pb2.GenerateResponse(
            request_id=current_request_id(), finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=self.chunks, model="m@1", cost_micros=7))


async def _get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        return await http.get(url)


async def _post(url: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
        return await http.post(url, **kwargs)


class Door:
    def __init__(self, servicer: Scripted, server: HttpServer) -> None:
        self.servicer, self.server = servicer, server
        self.is_serving = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture
async def door() -> AsyncIterator[Door]:
    servicer = Scripted()
    holder: list[Door] = []
    config = GatewayConfig(http_port=-1, http_max_body_bytes=4096)
    app = HttpDoor(config, servicer, lambda: ["m", "m@1"],  # type: ignore[arg-type]
                   lambda: (holder[0].is_serving, "" if holder[0].is_serving else "draining"))
    server = HttpServer(app, "127.0.0.1", -1, grace_s=1)
    holder.append(Door(servicer, server))
    await server.start()
    try:
        yield holder[0]
    finally:
        await server.close()


async def test_whole_chat_answer_and_the_call_it_made(door: Door) -> None:
    async with openai.AsyncOpenAI(base_url=door.url + "/v1", api_key="sk-1", max_retries=0,
                                  timeout=TIMEOUT_S) as api:
        answer = await api.chat.completions.create(model="m", messages=[{"role": "developer", "content": "be brief"},
                                                                        {"role": "user", "content": "hi"}],
                                                   max_completion_tokens=5, stop="x", seed=4, user="u1",
                                                   extra_headers={"x-aiserve-session": "s1"})
    assert answer.choices[0].message.content == "w0 w1 " and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.total_tokens == 5
    assert answer.usage.model_extra == {"cost_micros": 7, "cache_hit": False, "cache_similarity": 0.0,
                                        "queue_ms": 0, "ttft_ms": 0, "total_ms": 0, "model": "m@1"}
    ((api_name, request, call),) = door.servicer.calls
    assert api_name == "Complete" and call == CallInfo("Bearer sk-1", "s1", None, "u1")
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert request.sampling.max_new_tokens == 5 and list(request.sampling.stop) == ["x"]
    assert request.sampling.seed == 4 and request.model == "m"


@pytest.mark.parametrize(("error", "status", "kind"), [
    (Unauthenticated("authorization: unknown or revoked API key"), 401, openai.AuthenticationError),
    (NotFound("model: 'x' is not served"), 404, openai.NotFoundError),
    (FailedPrecondition("tokenizer sha256 differs from the model's"), 412, openai.APIStatusError),
    (ResourceExhausted("tenant over its requests per minute", retry_after_ms=1500), 429, openai.RateLimitError),
    (Unavailable("inference: no replica serving"), 503, openai.InternalServerError),
    (Internal("tokenizer: bug"), 500, openai.InternalServerError),
    (RuntimeError("a bug"), 500, openai.InternalServerError),
])
async def test_each_error_has_the_status_of_its_grpc_code(door: Door, error: BaseException, status: int,
                                                     kind: type[openai.APIStatusError]) -> None:
    door.servicer.error, door.servicer.chunks = error, 0
    with pytest.raises(kind) as info:
        await door.client().chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-request-id": "rid-1"})
    assert info.value.status_code == status
    body: Any = info.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert info.value.response.headers["x-request-id"] == "rid-1"
    if isinstance(error, ApiError):
        assert error.message in body["message"]
    if status == 500:
        assert "request_id=rid-1" in body["message"]
    if status == 429:
        assert info.value.response.headers["retry-after"] == "2"
        assert info.value.response.headers["retry-after-ms"] == "1500"


async def test_an_error_after_the_stream_began_is_an_event(door: Door) -> None:
    door.servicer.error = Unavailable("inference: replica went away")
    stream = await door.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         stream=True)
    with pytest.raises(openai.APIError) as info:
        [chunk async for chunk in stream]
    assert "replica went away" in info.value.message


async def test_completions_stream_and_logprobs_shape(door: Door) -> None:
    stream = await door.client().completions.create(model="m", prompt="p", stream=True, logprobs=2,
                                                    stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w0 w1 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    (_, request, _), = door.servicer.calls
    assert request.logprobs.enabled and request.logprobs.top_logprobs == 2 and request.prompt == "p"


async def test_response_format_reaches_the_request(door: Door) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await door.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    await door.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                          response_format={"type": "json_object"})
    (_, first, _), (_, second, _) = door.servicer.calls
    assert first.response_format.json_schema.name == "n" and first.response_format.json_schema.strict
    assert json.loads(first.response_format.json_schema.schema) == schema
    assert second.response_format.WhichOneof("format") == "json_object"


async def test_the_cache_control_header_sets_every_choice_s_cache_policy(door: Door) -> None:
    await door.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2,
                                                extra_headers={"Cache-Control": "no-store"})
    await door.client().completions.create(model="m", prompt="p", extra_headers={"cache-control": "no-cache"})
    await door.client().completions.create(model="m", prompt="p")
    policies = [request.cache for _, request, _ in door.servicer.calls]
    assert policies == [gateway_pb2.CACHE_POLICY_BYPASS] * 2 + [gateway_pb2.CACHE_POLICY_REFRESH,
                                                                 gateway_pb2.CACHE_POLICY_USE]


async def test_health_follows_the_gateway(door: Door) -> None:
    assert (await _get(door.url + "/health")).json() == {"status": "serving"}
    door.is_serving = False
    reply = await _get(door.url + "/health")
    assert reply.status_code == 503 and reply.json() == {"status": "not_serving", "reason": "draining"}


async def test_models_and_unknown_routes(door: Door) -> None:
    assert [m.id for m in (await door.client().models.list()).data] == ["m", "m@1"]
    reply = await _get(door.url + "/v1/embeddings")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
    reply = await _get(door.url + "/v1/chat/completions")
    assert reply.status_code == 405 and reply.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(("headers", "body", "status", "needle"), [
    ({"content-type": "application/json"}, b"{", 400, "not valid JSON"),
    ({"content-type": "text/plain"}, b"{}", 400, "content-type"),
    ({"content-type": "application/json"}, b"x" * 5000, 413, "at most 4096 bytes"),
    ({"content-type": "application/json", "x-request-id": "bad id"}, b"{}", 400, "x-request-id"),
])
async def test_bodies_and_headers_refused_before_any_work(door: Door, headers: dict[str, str], body: bytes, status: int,
                                                    needle: str) -> None:
    reply = await _post(door.url + "/v1/chat/completions", content=body, headers=headers)
    assert reply.status_code == status and needle in reply.json()["error"]["message"]
    assert door.servicer.calls == []


async def test_a_chunked_body_over_the_limit_is_413(door: Door) -> None:
    async def parts() -> Any:
        for _ in range(10):
            yield b"x" * 1000

    reply = await _post(door.url + "/v1/completions", content=parts(),
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413


async def test_a_stop_lets_the_stream_in_flight_finish_and_takes_no_new_request(door: Door) -> None:
    door.servicer.gate = asyncio.Event()
    body = {"model": "m", "prompt": "p", "stream": True}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as http, \
            http.stream("POST", door.url + "/v1/completions", json=body) as reply:
        lines = reply.aiter_lines()
        assert (await anext(lines)).startswith("data: {")  # the stream began
        closing = asyncio.ensure_future(door.server.close())
        await asyncio.sleep(0)  # one step of the loop: the stop begins (no wait for time)
        assert door.server.server.should_exit
        door.servicer.gate.set()
        rest = [line async for line in lines]
        await asyncio.wait_for(closing, TIMEOUT_S)
    assert rest[-2:] == ["data: [DONE]", ""]
    with pytest.raises(httpx.ConnectError):
        await _get(door.url + "/health")
