"""The tokenizer's unary calls as the pipeline needs them: render a chat, tokenize a prompt,
count tokens.

The edge: the ``PromptTokenizer`` of ``services/gateway/interfaces.py`` over gRPC; a failed
call becomes the ``ApiError`` the caller should see (``backend_errors.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from aiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend_errors import downstream_error
from services.gateway.domain import RenderedPrompt

TOKENIZER_TIMEOUT_S = 30.0
"""Deadline of one unary tokenizer call, in seconds."""


def _messages_to_pb(messages: Sequence[tuple[str, str]]) -> list[common_pb2.Message]:
    return [common_pb2.Message(role=role, content=content) for role, content in messages]


class TokenizerClient:
    """Renders and tokenizes prompts on the tokenizer service."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._stub = stub

    async def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
        """A chat rendered with the model's template and the generation prompt."""
        request = tokenizer_pb2.ApplyChatTemplateRequest(messages=_messages_to_pb(messages),
                                                         add_generation_prompt=True)
        try:
            rendered = await self._stub.ApplyChatTemplate(request, timeout=TOKENIZER_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc
        return RenderedPrompt(rendered.text, tuple(rendered.token_ids))

    async def tokenize(self, text: str) -> tuple[int, ...]:
        """A raw prompt's ids, with the model's special tokens."""
        request = tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=True)
        try:
            reply = await self._stub.Tokenize(request, timeout=TOKENIZER_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc
        return tuple(reply.token_ids)

    async def token_bytes(self, ids: Sequence[int]) -> tuple[bytes, ...]:
        """The bytes each id stands for alone (log-probabilities show them)."""
        try:
            reply = await self._stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=ids),
                                                timeout=TOKENIZER_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc
        return tuple(reply.token_bytes)

    async def count_tokens(self, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                           model: str) -> int:
        """Tokens of a prompt or a chat, exactly as a generation would render it."""
        if messages is not None:
            request = common_pb2.CountTokensRequest(chat=common_pb2.Chat(messages=_messages_to_pb(messages)),
                                                    model=model)
        else:
            request = common_pb2.CountTokensRequest(prompt=prompt or "", model=model)
        try:
            reply = await self._stub.CountTokens(request, timeout=TOKENIZER_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise downstream_error("tokenizer", exc) from exc
        return int(reply.token_count)
