"""The tokenizer's unary calls as the pipeline sees them, against a fake tokenizer over a real
gRPC socket: domain values in and out, a failed call as the caller should see it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from aiserve.common.errors import InvalidArgument, Unavailable
from aiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.domain import RenderedPrompt
from services.gateway.tokenizer_client import TokenizerClient
from tests.unit.gateway.fakes import fake_backend

TIMEOUT_S = 10.0


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """One id per word (the word's length); "bad" is refused, "down" is unavailable."""

    async def Tokenize(self, request, context):  # noqa: N802, ANN001, ANN201
        if request.text == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: not valid UTF-8")
        if request.text == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stopping")
        assert request.add_special_tokens  # a raw prompt gets the model's special tokens
        return tokenizer_pb2.TokenizeResponse(token_ids=[len(w) for w in request.text.split()])

    async def ApplyChatTemplate(self, request, context):  # noqa: N802, ANN001, ANN201
        assert request.add_generation_prompt
        text = "".join(f"<{m.role}>{m.content}" for m in request.messages) + "<assistant>"
        return tokenizer_pb2.ApplyChatTemplateResponse(text=text, token_ids=[1] * len(request.messages))

    async def CountTokens(self, request, context):  # noqa: N802, ANN001, ANN201
        words = request.prompt.split() if request.WhichOneof("input") == "prompt" else request.chat.messages
        return common_pb2.CountTokensResponse(token_count=len(words) * (10 if request.model == "m@1" else 1))


@pytest_asyncio.fixture
async def client() -> AsyncIterator[TokenizerClient]:
    async with fake_backend(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, FakeTokenizer()) as channel:
        yield TokenizerClient(tokenizer_pb2_grpc.TokenizerStub(channel))


async def test_render_tokenize_and_count(client: TokenizerClient) -> None:
    rendered = await asyncio.wait_for(client.apply_chat_template((("system", "s"), ("user", "u"))), TIMEOUT_S)
    assert rendered == RenderedPrompt("<system>s<user>u<assistant>", (1, 1))
    assert await asyncio.wait_for(client.tokenize("a bb ccc"), TIMEOUT_S) == (1, 2, 3)
    assert await asyncio.wait_for(client.count_tokens("a bb ccc", None, "m@1"), TIMEOUT_S) == 30
    assert await asyncio.wait_for(client.count_tokens(None, (("user", "hi"),), "m@1"), TIMEOUT_S) == 10


async def test_a_failed_call_is_the_error_the_caller_sees(client: TokenizerClient) -> None:
    with pytest.raises(InvalidArgument, match="text: not valid UTF-8"):
        await asyncio.wait_for(client.tokenize("bad"), TIMEOUT_S)
    with pytest.raises(Unavailable, match="tokenizer unavailable: stopping"):
        await asyncio.wait_for(client.tokenize("down"), TIMEOUT_S)
