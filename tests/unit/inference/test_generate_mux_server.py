"""GenerateMux, the server end (generate_mux_server.py), on the inference service in-process
(real model, float32), over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from grpc import aio

from aiserve.common.config import config_with
from aiserve.common.server import ServiceHandle
from aiserve.store import ModelStore
from aiserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.server import InferenceServicer, create_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT_S = 60.0
PROMPT = [1, 9690, 198, 19556, 30, 2, 198, 1, 520, 9531, 198]  # system 'Hello.', then the assistant's turn
LONG = 1000  # new tokens no test waits for: these generations end by cancel, deadline or the call's end


@dataclass
class Served:
    handle: ServiceHandle
    stub: inference_pb2_grpc.InferenceStub


@asynccontextmanager
async def serving(store: ModelStore) -> AsyncIterator[Served]:
    """The inference service on a free port, stopped on exit."""
    config = config_with(InferenceConfig, port=0, metrics_port=0, dtype="float32", model_store=str(store.root),
                         max_num_seqs=4, kv_cache_bytes=256 << 20, max_seq_len=1024)
    handle = await create_server(config)
    try:
        await handle.start()
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            yield Served(handle, inference_pb2_grpc.InferenceStub(channel))
    finally:
        await handle.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(store: ModelStore, two_torch_threads: None) -> AsyncIterator[Served]:
    async with serving(store) as served:
        yield served


def start(stream: int, max_new_tokens: int = 5, timeout_ms: int = 0, prompt: list[int] | None = None,
          **fields: object) -> inference_pb2.GenerateMuxItem:
    decoding = inference_pb2.Decoding(max_new_tokens=max_new_tokens, ignore_eos=True)
    request = inference_pb2.InferenceRequest(request_id=f"s{stream}", decoding=decoding,
                                             prompt_token_ids=PROMPT if prompt is None else prompt,
                                             **fields)  # type: ignore[arg-type]
    return inference_pb2.GenerateMuxItem(stream=stream, request=request, timeout_ms=timeout_ms)


class Mux:
    """A GenerateMux call: ``send`` items, ``until`` a stream is closed (its events so far)."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self.call = stub.GenerateMux(timeout=TIMEOUT_S)
        self.events: dict[int, list[inference_pb2.GenerateMuxEvent]] = {}
        self.replies: list[inference_pb2.GenerateMuxResponse] = []

    async def send(self, *items: inference_pb2.GenerateMuxItem) -> None:
        await self.call.write(inference_pb2.GenerateMuxRequest(items=items))

    async def until(self, *streams: int, first_only: bool = False) -> None:
        """Read until each of ``streams`` has ended (or has its first event)."""
        def pending() -> bool:
            return any(not (seen := self.events.get(s)) or not (first_only or closes(seen[-1])) for s in streams)

        while pending():
            reply = await asyncio.wait_for(self.call.read(), TIMEOUT_S)
            assert reply is not aio.EOF
            self.replies.append(reply)
            for event in reply.events:
                self.events.setdefault(event.stream, []).append(event)


def closes(event: inference_pb2.GenerateMuxEvent) -> bool:
    return bool(event.code) or event.response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def engine_of(served: Served) -> BatchEngine:
    assert isinstance(servicer := served.handle.servicer, InferenceServicer)
    return servicer.engine


async def engine_idle(served: Served) -> bool:
    return await engine_of(served).wait_idle(TIMEOUT_S)


def generated_tokens(served: Served) -> int:
    return engine_of(served).stats().num_generated_tokens


async def test_streams_get_what_generate_gives_with_a_step_in_one_message(served: Served) -> None:
    lengths = {1: 3, 2: 7, 3: 5, 4: 6}
    alone = {}
    for stream, n in lengths.items():
        request = start(stream, n).request
        alone[stream] = [list(m.token_ids) async for m in served.stub.Generate(request, timeout=TIMEOUT_S)]
    mux = Mux(served.stub)
    await mux.send(*(start(stream, n) for stream, n in lengths.items()))
    await mux.until(*lengths)
    mux.call.cancel()
    for stream, n in lengths.items():
        events = mux.events[stream]
        assert [list(e.response.token_ids) for e in events] == alone[stream]
        assert all(e.code == 0 and e.response.request_id == f"s{stream}" for e in events)
        last = events[-1].response
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.prompt_tokens, last.completion_tokens) == (len(PROMPT), n) and last.compute_ms > 0
    # one engine step's events travel together: far fewer messages than events
    assert max(len({e.stream for e in reply.events}) for reply in mux.replies) == 4
    assert len(mux.replies) < sum(lengths.values()) / 2
    assert await engine_idle(served)


async def test_a_bad_item_fails_its_own_stream_only(served: Served) -> None:
    before = generated_tokens(served)
    mux = Mux(served.stub)
    await mux.send(start(1, LONG), start(2, prompt=[]), start(3, model="other@9"),
                   inference_pb2.GenerateMuxItem(stream=4), start(5, prompt=[10**6]))
    await mux.send(start(1, 4))  # a second start of an open stream closes it too
    await mux.until(1, 2, 3, 4, 5)
    mux.call.cancel()
    failures = {s: (grpc.StatusCode.INVALID_ARGUMENT.value[0] if s != 3 else grpc.StatusCode.NOT_FOUND.value[0])
                for s in (2, 3, 4, 5)}
    assert {s: mux.events[s][-1].code for s in failures} == failures
    assert "prompt_token_ids: must hold at least 1 id" in mux.events[2][-1].message
    assert "model: 'other@9' is not loaded here" in mux.events[3][-1].message
    assert "items[3].request: required unless cancel is set" in mux.events[4][-1].message
    assert "id 1000000 is outside the vocabulary" in mux.events[5][-1].message
    assert mux.events[1][-1].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "stream: 1 is already open" in mux.events[1][-1].message
    assert await engine_idle(served)  # the closed stream 1 left the batch ...
    assert generated_tokens(served) - before < LONG  # ... long before its LONG tokens


async def test_a_bug_in_one_start_fails_that_stream_with_internal_only(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_of(served)
    submit = engine.submit

    def broken_for_s2(request, deliver):  # noqa: ANN001, ANN202
        if request.request_id == "s2":
            raise RuntimeError("a bug")
        return submit(request, deliver)

    monkeypatch.setattr(engine, "submit", broken_for_s2)
    mux = Mux(served.stub)
    await mux.send(start(1, 3), start(2, 3), start(3, 3))
    await mux.until(1, 2, 3)
    mux.call.cancel()
    assert mux.events[2][-1].code == grpc.StatusCode.INTERNAL.value[0]
    assert "internal error (request_id=s2)" in mux.events[2][-1].message and "a bug" not in mux.events[2][-1].message
    for stream in (1, 3):  # the call kept reading and serving the others
        assert mux.events[stream][-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_a_cancel_item_takes_the_generation_out_and_the_call_goes_on(served: Served) -> None:
    before = generated_tokens(served)
    mux = Mux(served.stub)
    await mux.send(start(1, LONG))
    await mux.until(1, first_only=True)
    await mux.send(inference_pb2.GenerateMuxItem(stream=1, cancel=True))
    assert await engine_idle(served)  # out of the batch, its KV slot freed ...
    assert generated_tokens(served) - before < LONG  # ... long before its LONG tokens
    stats = await served.stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    await mux.send(start(2, 2))
    await mux.until(2)
    assert mux.events[2][-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not any(closes(e) for e in mux.events[1])  # no answer to a cancel
    mux.call.cancel()


async def test_a_deadline_that_passes_while_running_ends_the_stream(served: Served) -> None:
    before = generated_tokens(served)
    mux = Mux(served.stub)
    await mux.send(start(1, LONG, timeout_ms=1500))
    await mux.until(1)
    *tokens, last = mux.events[1]
    assert last.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    # the stream's timer ended it (not the queue): it reports the tokens it had sent
    made = tokens[-1].response.completion_tokens if tokens else 0
    assert last.message == f"deadline passed after {made} generated tokens"
    assert await engine_idle(served)
    assert generated_tokens(served) - before < LONG  # the generation left the batch
    mux.call.cancel()


async def test_ending_the_call_cancels_its_generations(served: Served) -> None:
    before = generated_tokens(served)
    mux = Mux(served.stub)
    await mux.send(start(1, LONG), start(2, LONG))
    await mux.until(1, 2, first_only=True)
    mux.call.cancel()
    assert await engine_idle(served)
    assert generated_tokens(served) - before < LONG  # neither ran to its end


async def test_stopping_refuses_new_streams_and_ends_the_call_after_the_running_ones(
        store: ModelStore, two_torch_threads: None) -> None:
    """On a service of its own: stopping is for good."""
    async with serving(store) as served:
        mux = Mux(served.stub)
        await mux.send(start(1, 8))
        await mux.until(1, first_only=True)
        for stopping in served.handle.on_stopping:  # what SIGTERM runs before the grace period
            stopping()
        await mux.send(start(2, 2))
        await mux.until(1, 2)
        assert mux.events[1][-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH  # finished its work
        assert mux.events[2][-1].code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert await asyncio.wait_for(mux.call.read(), TIMEOUT_S) is aio.EOF  # then the call ends
        assert await mux.call.code() == grpc.StatusCode.OK
