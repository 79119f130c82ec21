"""The tokenizer service's streaming RPCs over a real gRPC socket: DetokenizeStream (one
generation per call) and DetokenizeMux (many generations over one call)."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from aiserve.v1 import tokenizer_pb2
from services.tokenizer.tokenizer import ModelTokenizer
from tests.unit.tokenizer.conftest import CHINESE, TIMEOUT_S, Stub

# One server (conftest.py) and one event loop for the module.
pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_detokenize_stream_one_id_per_message(stub: Stub, tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode(CHINESE)
    call = stub.DetokenizeStream(timeout=TIMEOUT_S)
    deltas = []
    for token_id in ids:
        await call.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=[token_id]))
        deltas.append((await call.read()).text_delta)  # exactly one answer per message
    await call.done_writing()
    final = await call.read()
    assert await call.read() == aio.EOF
    assert final.text_delta == ""  # always sent, empty here: the text was complete
    assert "".join(deltas) == CHINESE
    assert all("\ufffd" not in delta for delta in deltas)
    assert await call.code() == grpc.StatusCode.OK


async def test_detokenize_stream_sends_the_rest_on_close(stub: Stub,
                                                         tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("你")[:1]  # the first byte of a 3-byte character
    requests = [tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids)]
    replies = [r.text_delta async for r in stub.DetokenizeStream(iter(requests),
                                                                  timeout=TIMEOUT_S)]
    assert replies == ["", "\ufffd"]
    empty = [r.text_delta async for r in stub.DetokenizeStream(iter([]), timeout=TIMEOUT_S)]
    assert empty == [""]


async def test_detokenize_stream_bad_id(stub: Stub) -> None:
    requests = [tokenizer_pb2.DetokenizeStreamRequest(token_ids=[5]),
                tokenizer_pb2.DetokenizeStreamRequest(token_ids=[49152])]
    call = stub.DetokenizeStream(iter(requests), timeout=TIMEOUT_S)
    with pytest.raises(aio.AioRpcError) as info:
        _ = [r async for r in call]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[0]: 49152 is outside [0, 49152)" in (info.value.details() or "")


def _item(stream: int, *ids: int, start: bool = False, end: bool = False,
          cancel: bool = False) -> tokenizer_pb2.DetokenizeMuxItem:
    return tokenizer_pb2.DetokenizeMuxItem(stream=stream, token_ids=ids, start=start, end=end, cancel=cancel,
                                           skip_special_tokens=start)


async def _mux(call: aio.StreamStreamCall, *items: tokenizer_pb2.DetokenizeMuxItem,
               ) -> list[tokenizer_pb2.DetokenizeMuxDelta]:
    await call.write(tokenizer_pb2.DetokenizeMuxRequest(items=items))
    return list((await call.read()).deltas)  # type: ignore[union-attr]


async def test_detokenize_mux_interleaves_generations(stub: Stub, tokenizer: ModelTokenizer) -> None:
    """Two generations in the same messages (one id each per message, as engine steps make
    them) come out exactly as each alone, with no broken character, one delta per item."""
    texts = {7: CHINESE, 9: "Hello, wide world! 🙂"}
    ids = {s: tokenizer.encode(t) for s, t in texts.items()}
    call = stub.DetokenizeMux(timeout=TIMEOUT_S)
    out: dict[int, list[str]] = {7: [], 9: []}
    for step in range(max(len(v) for v in ids.values())):
        items = [_item(s, v[step], start=step == 0) for s, v in ids.items() if step < len(v)]
        deltas = await _mux(call, *items)
        assert [d.stream for d in deltas] == [i.stream for i in items]
        for d in deltas:
            assert d.code == 0 and "\ufffd" not in d.text_delta
            out[d.stream].append(d.text_delta)
    for d in await _mux(call, _item(7, end=True), _item(9, end=True)):
        out[d.stream].append(d.text_delta)
    assert {s: "".join(v) for s, v in out.items()} == texts
    await call.done_writing()
    assert await call.read() == aio.EOF and await call.code() == grpc.StatusCode.OK


async def test_detokenize_mux_end_flushes_and_cancel_forgets(stub: Stub, tokenizer: ModelTokenizer) -> None:
    first_byte = tokenizer.encode("你")[:1]  # the first byte of a 3-byte character: held back
    call = stub.DetokenizeMux(timeout=TIMEOUT_S)
    held = await _mux(call, _item(1, *first_byte, start=True), _item(2, *first_byte, start=True))
    assert [(d.stream, d.text_delta) for d in held] == [(1, ""), (2, "")]
    # cancel answers nothing and closes the stream; end flushes the held-back byte
    ended = await _mux(call, _item(2, cancel=True), _item(1, end=True))
    assert [(d.stream, d.text_delta, d.code) for d in ended] == [(1, "\ufffd", 0)]
    after = await _mux(call, _item(1, 5), _item(2, 5))
    assert [d.code for d in after] == [grpc.StatusCode.FAILED_PRECONDITION.value[0]] * 2
    assert "items[0].stream: 1 is not open" in after[0].message
    call.cancel()


async def test_detokenize_mux_bad_item_fails_only_its_stream(stub: Stub) -> None:
    call = stub.DetokenizeMux(timeout=TIMEOUT_S)
    deltas = await _mux(call, _item(1, 5, start=True), _item(2, 5, 49152, start=True), _item(1, start=True))
    assert deltas[0].code == 0
    assert deltas[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert deltas[1].message == "items[1].token_ids[1]: 49152 is outside [0, 49152)"
    assert deltas[2].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "items[2].stream: 1 is already open" in deltas[2].message
    # The failed stream is closed, the call goes on (the start of 1 closed stream 1 as well)
    again = await _mux(call, _item(2, 5, start=True), _item(1, 6, start=True))
    assert [d.code for d in again] == [0, 0]
    call.cancel()


async def test_detokenize_mux_bounds_open_streams(stub: Stub, monkeypatch: pytest.MonkeyPatch) -> None:
    import services.tokenizer.server as tokenizer_server

    monkeypatch.setattr(tokenizer_server, "MAX_MUX_STREAMS", 2)
    call = stub.DetokenizeMux(timeout=TIMEOUT_S)
    deltas = await _mux(call, *(_item(s, 5, start=True) for s in (1, 2, 3)))
    assert [d.code for d in deltas] == [0, 0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert "items[2].stream: at most 2 streams may be open in one call" in deltas[2].message
    ended = await _mux(call, _item(1, end=True), _item(3, 5, start=True))  # a closed stream frees a place
    assert [d.code for d in ended] == [0, 0]
    call.cancel()
