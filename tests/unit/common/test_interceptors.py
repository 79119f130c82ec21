"""The server interceptor over real gRPC: request ids, status mapping, and survival of bugs."""

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from aiserve.common.context import current_request_id
from aiserve.common.errors import InvalidArgument
from aiserve.common.server import ServiceHandle, new_server
from aiserve.v1 import cache_pb2, cache_pb2_grpc, tokenizer_pb2_grpc


class FakeCache(cache_pb2_grpc.CacheServicer):
    async def Lookup(self, request: cache_pb2.LookupRequest, context: aio.ServicerContext) -> cache_pb2.LookupResponse:  # noqa: N802
        if request.prompt == "bad":
            raise InvalidArgument("prompt: must not be 'bad'")
        if request.prompt == "bug":
            raise RuntimeError("boom")
        return cache_pb2.LookupResponse(entry_id=current_request_id())


@pytest.fixture
async def server() -> AsyncIterator[ServiceHandle]:
    handle = new_server("test", ["aiserve.v1.Cache"], "127.0.0.1", 0)
    cache_pb2_grpc.add_CacheServicer_to_server(FakeCache(), handle.server)
    await handle.start()
    try:
        yield handle
    finally:
        await handle.stop(0)


async def _lookup(
    handle: ServiceHandle, prompt: str, metadata: tuple = ()
) -> tuple[cache_pb2.LookupResponse, aio.Metadata]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        call = cache_pb2_grpc.CacheStub(channel).Lookup(
            cache_pb2.LookupRequest(prompt=prompt), metadata=metadata, timeout=5
        )
        reply = await call
        return reply, await call.initial_metadata()


async def test_request_id_is_taken_bound_and_echoed(server: ServiceHandle) -> None:
    reply, metadata = await _lookup(server, "ok", (("x-request-id", "abc-123"),))
    assert reply.entry_id == "abc-123"  # the handler saw it through the ContextVar
    assert dict(metadata)["x-request-id"] == "abc-123"


async def test_request_id_is_minted_when_absent(server: ServiceHandle) -> None:
    reply, metadata = await _lookup(server, "ok")
    assert len(reply.entry_id) == 32 and dict(metadata)["x-request-id"] == reply.entry_id


async def test_malformed_request_id_is_invalid_argument(server: ServiceHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "ok", (("x-request-id", "has space"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-request-id" in info.value.details()


async def test_api_error_keeps_its_code_and_a_bug_is_internal_with_the_id(server: ServiceHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "bad")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "bug", (("x-request-id", "bug-1"),))
    assert info.value.code() == grpc.StatusCode.INTERNAL and "bug-1" in info.value.details()
    reply, _ = await _lookup(server, "ok")  # still serving
    assert reply.entry_id


class EchoTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Answers unary and bidi calls with the request id the server saw."""

    async def Tokenize(self, request, context):  # noqa: N802, ANN001, ANN201
        from aiserve.v1 import tokenizer_pb2

        return tokenizer_pb2.TokenizeResponse(token_ids=[len(current_request_id())])

    async def DetokenizeStream(self, request_iterator, context):  # noqa: N802, ANN001, ANN201
        from aiserve.v1 import tokenizer_pb2

        async for _ in request_iterator:
            yield tokenizer_pb2.DetokenizeStreamResponse(text_delta=current_request_id())


async def test_downstream_channel_forwards_the_request_id_on_unary_and_streaming_calls() -> None:
    from aiserve.common.context import request_id_var
    from aiserve.common.interceptors import downstream_channel
    from aiserve.v1 import inference_pb2, inference_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

    class EchoInference(inference_pb2_grpc.InferenceServicer):
        async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
            yield inference_pb2.InferenceResponse(request_id=current_request_id())

    handle = new_server("test", ["aiserve.v1.Tokenizer", "aiserve.v1.Inference"], "127.0.0.1", 0)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(EchoTokenizer(), handle.server)
    inference_pb2_grpc.add_InferenceServicer_to_server(EchoInference(), handle.server)
    await handle.start()
    try:
        request_id_var.set("fwd-42")
        channel = downstream_channel(f"127.0.0.1:{handle.port}")
        async with channel:
            unary = await tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(
                tokenizer_pb2.TokenizeRequest(text="x"), timeout=5
            )
            assert unary.token_ids == [len("fwd-42")]
            server_stream = inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.InferenceRequest(), timeout=5
            )
            assert [m.request_id async for m in server_stream] == ["fwd-42"]
            bidi = tokenizer_pb2_grpc.TokenizerStub(channel).DetokenizeStream(timeout=5)
            await bidi.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[1]))
            assert (await bidi.read()).text_delta == "fwd-42"
            await bidi.done_writing()
    finally:
        await handle.stop(0)
