"""The fake tokenizer and inference services test_server.py and test_fleet.py run the real
gateway against (each a real server on a free port, whose health the test sets)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiserve.common.server import ServiceHandle, new_server
from aiserve.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

MODEL = "fake@1"


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """One token per word; token id n detokenizes to "w{n} ". Counts its Tokenize and
    DetokenizeMux calls."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.tokenized = 0
        self.mux_calls = 0

    async def Info(self, request, context):  # noqa: N802, ANN001, ANN201
        return tokenizer_pb2.TokenizerInfo(model=self.model, tokenizer_sha256="abc", context_length=4096,
                                           vocab_size=100)

    async def Tokenize(self, request, context):  # noqa: N802, ANN001, ANN201
        self.tokenized += 1
        return tokenizer_pb2.TokenizeResponse(token_ids=[1] * len(request.text.split()))

    async def ApplyChatTemplate(self, request, context):  # noqa: N802, ANN001, ANN201
        text = " ".join(m.content for m in request.messages)
        return tokenizer_pb2.ApplyChatTemplateResponse(text=text, token_ids=[1] * (len(text.split()) + 2))

    async def DetokenizeMux(self, requests, context):  # noqa: N802, ANN001, ANN201
        self.mux_calls += 1
        async for request in requests:
            yield tokenizer_pb2.DetokenizeMuxResponse(deltas=[
                tokenizer_pb2.DetokenizeMuxDelta(stream=i.stream, text_delta="".join(f"w{t} " for t in i.token_ids))
                for i in request.items if not i.cancel])


@dataclass
class Seen:
    """What the fake inference saw of each request."""

    remaining_s: list[float] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    request_ids: list[str] = field(default_factory=list)
    mux_calls: int = 0
    """GenerateMux calls opened on this replica."""


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Streams max_new_tokens ids over GenerateMux (the gateway's one call); a prompt of exactly
    7 words hangs after one token. ``tokenizer_sha256`` other than the tokenizer's "abc" makes it
    a replica that fails the pairing check."""

    def __init__(self, seen: Seen, tokenizer_sha256: str = "abc", model: str = MODEL) -> None:
        self.seen = seen
        self.tokenizer_sha256 = tokenizer_sha256
        self.model = model

    async def Info(self, request, context):  # noqa: N802, ANN001, ANN201
        return inference_pb2.InferenceInfo(model=self.model, tokenizer_sha256=self.tokenizer_sha256,
                                           context_length=4096)

    async def GenerateMux(self, requests, context):  # noqa: N802, ANN001, ANN201
        self.seen.mux_calls += 1
        events: asyncio.Queue[inference_pb2.GenerateMuxEvent] = asyncio.Queue()
        running: dict[int, asyncio.Task[None]] = {}

        async def run(item: inference_pb2.GenerateMuxItem) -> None:
            async for message in self._generate(item.request, item.timeout_ms / 1000):
                events.put_nowait(inference_pb2.GenerateMuxEvent(stream=item.stream, response=message))

        async def read() -> None:
            async for batch in requests:
                for item in batch.items:
                    if item.cancel:
                        running.pop(item.stream).cancel()
                    else:
                        running[item.stream] = asyncio.create_task(run(item))

        reader = asyncio.create_task(read())
        try:
            while True:
                yield inference_pb2.GenerateMuxResponse(events=[await events.get()])
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        async for message in self._generate(request, context.time_remaining()):
            yield message

    async def _generate(self, request, remaining_s):  # noqa: ANN001, ANN202
        self.seen.remaining_s.append(remaining_s)
        self.seen.request_ids.append(request.request_id)
        self.seen.priorities.append(request.priority)
        n = request.decoding.max_new_tokens
        try:
            for i in range(n - 1):
                yield inference_pb2.InferenceResponse(token_ids=[10 + i])
                if len(request.prompt_token_ids) == 7:
                    await asyncio.Event().wait()  # until the caller cancels
            yield inference_pb2.InferenceResponse(
                token_ids=[99],
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                completion_tokens=n,
                prompt_tokens=len(request.prompt_token_ids),
                queue_ms=3,
                compute_ms=250,
                kv_peak_bytes=65536,
            )
        except asyncio.CancelledError:
            self.seen.cancelled.set()
            raise


class FakeCache(cache_pb2_grpc.CacheServicer):
    """Every lookup misses; stores are counted once their finish arrives."""

    def __init__(self) -> None:
        self.lookups = 0
        self.stores = 0

    async def Lookup(self, request, context):  # noqa: N802, ANN001, ANN201
        self.lookups += 1
        return cache_pb2.LookupResponse(hit=False)

    async def Store(self, requests, context):  # noqa: N802, ANN001, ANN201
        async for message in requests:
            if message.HasField("finish"):
                self.stores += 1
        return cache_pb2.StoreResponse(entry_id="e1")


def fake_server(name: str, servicer: object) -> ServiceHandle:
    """A fake tokenizer, inference or cache server with health and Status, on a free port (not started)."""
    handle = new_server(name, [], "127.0.0.1", 0)
    add = {"tokenizer": tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
           "inference": inference_pb2_grpc.add_InferenceServicer_to_server,
           "cache": cache_pb2_grpc.add_CacheServicer_to_server}[name]
    add(servicer, handle.server)  # type: ignore[operator]
    return handle


def fake_backends(seen: Seen) -> list[ServiceHandle]:
    """The fake tokenizer and inference servers, bound to free ports (not started)."""
    return [fake_server("tokenizer", FakeTokenizer()), fake_server("inference", FakeInference(seen))]
