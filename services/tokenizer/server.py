"""The tokenizer's gRPC servicer, ``create_server`` and ``main`` (docs/architecture.md).

Each RPC is thin: validate -> convert pb to domain values -> call ``ModelTokenizer`` ->
convert back. pb types never leave this module. Inputs larger than ``_THREAD_MIN_CHARS``
are tokenized in a worker thread so the event loop keeps serving other calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from grpc import aio

from aiserve.common.context import current_request_id
from aiserve.common.errors import ApiError, FailedPrecondition, NotFound, ResourceExhausted
from aiserve.common.logging import get_logger, log_startup
from aiserve.common.paths import model_store_path
from aiserve.common.protocol import MAX_MUX_STREAMS
from aiserve.common.server import ServiceHandle, new_server, run_service
from aiserve.common.status import code_number
from aiserve.store import ModelRef, ModelStore
from aiserve.v1 import common_pb2, status_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.tokenizer import ChatMessage, ModelTokenizer, TokenizerInfo

log = get_logger("tokenizer")

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Above this many characters (or ids x 4, about 4 characters a token) work runs in a thread.
_THREAD_MIN_CHARS = 10_000
_CHARS_PER_ID = 4

T = TypeVar("T")


async def _run(size: int, fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` inline when small, in a worker thread when ``size`` chars is large."""
    if size > _THREAD_MIN_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _messages_from_pb(messages: Iterable[common_pb2.Message]) -> list[ChatMessage]:
    return [ChatMessage(m.role, m.content) for m in messages]


def _chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.content) for m in messages)


def _info_to_pb(info: TokenizerInfo) -> tokenizer_pb2.TokenizerInfo:
    return tokenizer_pb2.TokenizerInfo(
        model=info.model,
        tokenizer_sha256=info.tokenizer_sha256,
        vocab_size=info.vocab_size,
        special_tokens=[tokenizer_pb2.SpecialToken(name=t.name, content=t.content, id=t.id)
                        for t in info.special_tokens],
        context_length=info.context_length,
        eos_token_ids=list(info.eos_token_ids),
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """aiserve.v1.Tokenizer over one ``ModelTokenizer``. Stateless between calls."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def tokenizer(self) -> ModelTokenizer:
        """The model tokenizer every call uses."""
        return self._tokenizer

    def figures(self) -> status_pb2.ServiceStatus:
        """This service's part of its Status rpc: the model (``name@version``) it serves."""
        return status_pb2.ServiceStatus(model=self._tokenizer.info.model)

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        """Token ids of ``text``; empty text -> INVALID_ARGUMENT."""
        ids = await _run(len(request.text), self._tokenizer.encode, request.text,
                         request.add_special_tokens)
        return tokenizer_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: tokenizer_pb2.DetokenizeRequest,
                         context: aio.ServicerContext) -> tokenizer_pb2.DetokenizeResponse:
        """Text of ``token_ids``; an id outside [0, vocab_size) -> INVALID_ARGUMENT."""
        ids = list(request.token_ids)
        text = await _run(len(ids) * _CHARS_PER_ID, self._tokenizer.decode, ids,
                          request.skip_special_tokens)
        return tokenizer_pb2.DetokenizeResponse(text=text)

    async def TokenBytes(self, request: tokenizer_pb2.TokenBytesRequest,  # noqa: N802
                         context: aio.ServicerContext) -> tokenizer_pb2.TokenBytesResponse:
        """The bytes of each id alone; an id outside [0, vocab_size) -> INVALID_ARGUMENT."""
        pieces = await _run(len(request.token_ids) * _CHARS_PER_ID, self._tokenizer.token_bytes,
                            list(request.token_ids))
        return tokenizer_pb2.TokenBytesResponse(token_bytes=pieces)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: aio.ServicerContext,
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        """The conversation rendered by the model's chat template, and its token ids."""
        messages = _messages_from_pb(request.messages)
        text, ids = await _run(_chars(messages), self._tokenizer.encode_chat, messages,
                               request.add_generation_prompt)
        return tokenizer_pb2.ApplyChatTemplateResponse(text=text, token_ids=ids)

    async def CountTokens(self, request: common_pb2.CountTokensRequest,
                          context: aio.ServicerContext) -> common_pb2.CountTokensResponse:
        """Tokens of a prompt or chat as Generate renders it; another model -> NOT_FOUND."""
        info = self._tokenizer.info
        if request.model and request.model != info.model:
            raise NotFound(f"model: {request.model!r} is not served here; "
                           f"this tokenizer serves {info.model!r}")
        kind = request.WhichOneof("input")
        if kind == "chat":
            messages = _messages_from_pb(request.chat.messages)
            count = await _run(_chars(messages), self._tokenizer.count, None, messages)
        else:  # no input at all: count() raises INVALID_ARGUMENT
            prompt = request.prompt if kind == "prompt" else None
            count = await _run(len(request.prompt), self._tokenizer.count, prompt, None)
        return common_pb2.CountTokensResponse(token_count=count, context_length=info.context_length,
                                              model=info.model, request_id=current_request_id())

    async def Info(self, request: tokenizer_pb2.TokenizerInfoRequest,
                   context: aio.ServicerContext) -> tokenizer_pb2.TokenizerInfo:
        """Model name@version, tokenizer fingerprint, vocabulary, special tokens, context."""
        return _info_to_pb(self._tokenizer.info)

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        """One response per request message with the text its ids complete (maybe ""), then,
        when the client half-closes, always one last message with the held-back rest
        (maybe ""). ``skip_special_tokens`` is read from the first message."""
        detokenizer: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            if detokenizer is None:
                detokenizer = IncrementalDetokenizer(self._tokenizer, request.skip_special_tokens)
            delta = detokenizer.push(list(request.token_ids))
            yield tokenizer_pb2.DetokenizeStreamResponse(text_delta=delta)
        rest = detokenizer.flush() if detokenizer is not None else ""
        yield tokenizer_pb2.DetokenizeStreamResponse(text_delta=rest)

    async def DetokenizeMux(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeMuxRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeMuxResponse]:
        """DetokenizeStream for many generations over one call: one answer per request
        message, one delta per item except ``cancel``. A failed item closes its own stream only."""
        streams: dict[int, _MuxStream] = {}
        async for request in request_iterator:
            reply = tokenizer_pb2.DetokenizeMuxResponse()
            for index, item in enumerate(request.items):
                if item.cancel:
                    streams.pop(item.stream, None)
                    continue
                try:
                    delta = self._mux_item(streams, item)
                except ApiError as exc:
                    dropped = streams.pop(item.stream, None)
                    log.warning("detokenize_mux_item_failed", stream=item.stream, code=exc.kind.name,
                                error=exc.message, request_id=dropped.request_id if dropped else "")
                    reply.deltas.add(stream=item.stream, code=code_number(exc.kind),
                                     message=f"items[{index}].{exc.message}")
                else:
                    reply.deltas.add(stream=item.stream, text_delta=delta)
            yield reply

    def _mux_item(self, streams: dict[int, _MuxStream], item: tokenizer_pb2.DetokenizeMuxItem) -> str:
        if item.start:
            if item.stream in streams:
                raise FailedPrecondition(f"stream: {item.stream} is already open")
            if len(streams) >= MAX_MUX_STREAMS:
                raise ResourceExhausted(f"stream: at most {MAX_MUX_STREAMS} streams may be open in one call")
            streams[item.stream] = _MuxStream(
                IncrementalDetokenizer(self._tokenizer, item.skip_special_tokens), item.request_id)
        elif item.stream not in streams:
            raise FailedPrecondition(f"stream: {item.stream} is not open (its first item needs start)")
        detokenizer = streams[item.stream].detokenizer
        delta = detokenizer.push(list(item.token_ids))  # bad ids: InvalidArgument naming token_ids[i]
        if item.end:
            delta += detokenizer.flush()
            del streams[item.stream]
        return delta


@dataclass(frozen=True, slots=True)
class _MuxStream:
    detokenizer: IncrementalDetokenizer
    request_id: str


def load_tokenizer(config: TokenizerConfig) -> ModelTokenizer:
    """Verify ``config.model`` in the store (the sha256 of every file it reads: all but the
    weights, which the inference service verifies) and load its tokenizer.

    Raises ModelStoreError when the model is missing, tampered with or malformed.
    """
    store = ModelStore(model_store_path(config.model_store))
    folder, manifest = store.load_path(ModelRef.parse(config.model), weights=False)
    return ModelTokenizer.from_folder(folder, manifest)


async def create_server(config: TokenizerConfig) -> ServiceHandle:
    """Load and verify the model, then build the server (health NOT_SERVING, not started).

    The model is loaded before any port is bound, so a bad model never serves.
    """
    tokenizer = await asyncio.to_thread(load_tokenizer, config)
    log_startup("loaded")
    handle = new_server("tokenizer", [SERVICE_NAME], config.host, config.port)
    handle.servicer = servicer = TokenizerServicer(tokenizer)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, handle.server)
    handle.figures = servicer.figures
    log.info("tokenizer_loaded", model=tokenizer.info.model, vocab_size=tokenizer.vocab_size,
             tokenizer_sha256=tokenizer.info.tokenizer_sha256)
    return handle


def main(argv: list[str] | None = None) -> None:
    """Run the tokenizer service until SIGTERM/SIGINT. Exit code 2 on bad settings or model."""
    run_service("tokenizer", TokenizerConfig, create_server, argv)
