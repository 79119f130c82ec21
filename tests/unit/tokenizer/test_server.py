"""The tokenizer service over real gRPC sockets: every RPC, its errors, metadata and start-up."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc import aio

from aiserve.common.server import ServiceHandle, wait_for_serving
from aiserve.store import ModelStore, ModelStoreError
from aiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import create_server
from services.tokenizer.tokenizer import ChatMessage, ModelTokenizer

# One server (and one event loop) for the module: loading verifies ~0.5 GB of model hashes.
pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 10.0
MODEL = "smollm2-135m-instruct@0.1.2"
CHINESE = "你好，世界！我们去公园散步吧。🙂"
REPO_ROOT = Path(__file__).resolve().parents[3]
Stub = tokenizer_pb2_grpc.TokenizerStub


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(store: ModelStore) -> AsyncIterator[ServiceHandle]:
    config = TokenizerConfig(port=0, metrics_port=0, model_store=str(store.root))
    handle = await create_server(config)
    try:
        await handle.start()
        await handle.set_serving(True)
        yield handle
    finally:
        await handle.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server: ServiceHandle) -> AsyncIterator[Stub]:
    async with aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def _messages(*turns: tuple[str, str]) -> list[common_pb2.Message]:
    return [common_pb2.Message(role=role, content=content) for role, content in turns]


async def _expect_error(call: object, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code
    for fragment in fragments:
        assert fragment in (info.value.details() or "")


async def test_health_reports_serving(server: ServiceHandle) -> None:
    await wait_for_serving(f"127.0.0.1:{server.port}", TIMEOUT_S, "aiserve.v1.Tokenizer")


async def test_tokenize_and_detokenize(stub: Stub, tokenizer: ModelTokenizer) -> None:
    reply = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=CHINESE), timeout=TIMEOUT_S)
    assert list(reply.token_ids) == tokenizer.encode(CHINESE)
    back = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=reply.token_ids),
                                 timeout=TIMEOUT_S)
    assert back.text == CHINESE
    wrapped = tokenizer_pb2.DetokenizeRequest(token_ids=[1, *reply.token_ids, 2],
                                              skip_special_tokens=True)
    assert (await stub.Detokenize(wrapped, timeout=TIMEOUT_S)).text == CHINESE


async def test_large_input_runs_off_the_event_loop(stub: Stub, tokenizer: ModelTokenizer) -> None:
    text = "Long inputs leave the event loop. " * 1000  # > 10k characters: worker thread
    reply = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=TIMEOUT_S)
    assert list(reply.token_ids) == tokenizer.encode(text)
    back = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=reply.token_ids),
                                 timeout=TIMEOUT_S)
    assert back.text == text


async def test_apply_chat_template(stub: Stub, tokenizer: ModelTokenizer) -> None:
    request = tokenizer_pb2.ApplyChatTemplateRequest(
        messages=_messages(("system", "Be brief."), ("user", "Hi!")), add_generation_prompt=True)
    reply = await stub.ApplyChatTemplate(request, timeout=TIMEOUT_S)
    assert reply.text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                          "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert list(reply.token_ids) == tokenizer.encode(reply.text)


async def test_count_tokens(stub: Stub, tokenizer: ModelTokenizer) -> None:
    chat = common_pb2.Chat(messages=_messages(("user", "How many tokens is this?")))
    reply = await stub.CountTokens(common_pb2.CountTokensRequest(chat=chat, model=MODEL),
                                   metadata=(("x-request-id", "count-1"),), timeout=TIMEOUT_S)
    expected = tokenizer.count(messages=[ChatMessage("user", "How many tokens is this?")])
    assert reply.token_count == expected
    assert (reply.context_length, reply.model, reply.request_id) == (8192, MODEL, "count-1")
    prompt = common_pb2.CountTokensRequest(prompt="hello world")
    assert (await stub.CountTokens(prompt, timeout=TIMEOUT_S)).token_count == 2


async def test_info(stub: Stub, tokenizer: ModelTokenizer, store: ModelStore) -> None:
    info = await stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=TIMEOUT_S)
    manifest = json.loads((store.root / "smollm2-135m-instruct/0.1.2/manifest.json").read_text())
    assert info.model == MODEL
    assert info.tokenizer_sha256 == manifest["tokenizer_sha256"]
    assert (info.vocab_size, info.context_length, list(info.eos_token_ids)) == (49152, 8192, [2])
    named = {t.name: (t.content, t.id) for t in info.special_tokens if t.name != "additional"}
    assert named["eos"] == ("<|im_end|>", 2) and named["bos"] == ("<|im_start|>", 1)
    assert len(info.special_tokens) == len(tokenizer.info.special_tokens)


async def test_request_id_is_echoed(stub: Stub) -> None:
    call = stub.Info(tokenizer_pb2.TokenizerInfoRequest(),
                     metadata=(("x-request-id", "req-abc-123"),), timeout=TIMEOUT_S)
    await call
    assert ("x-request-id", "req-abc-123") in list(await call.initial_metadata())


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


async def test_error_codes(stub: Stub) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    await _expect_error(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=""), timeout=TIMEOUT_S),
                        bad, "text", "at least 1 character")
    request = tokenizer_pb2.DetokenizeRequest(token_ids=[1, 99999])
    await _expect_error(stub.Detokenize(request, timeout=TIMEOUT_S),
                        bad, "token_ids[1]", "[0, 49152)")
    chat = tokenizer_pb2.ApplyChatTemplateRequest(messages=_messages(("robot", "hi")))
    await _expect_error(stub.ApplyChatTemplate(chat, timeout=TIMEOUT_S), bad, "messages[0].role")
    other = common_pb2.CountTokensRequest(prompt="hi", model="llama-3@1.0")
    await _expect_error(stub.CountTokens(other, timeout=TIMEOUT_S), grpc.StatusCode.NOT_FOUND,
                        "llama-3@1.0", MODEL)
    neither = common_pb2.CountTokensRequest(model=MODEL)
    await _expect_error(stub.CountTokens(neither, timeout=TIMEOUT_S), bad, "prompt or chat")


@pytest.fixture
def tampered_store(tmp_path: Path, model_dir: Path) -> Path:
    """A store holding a copy of the model with one byte of tokenizer.json flipped."""
    folder = tmp_path / "smollm2-135m-instruct" / "0.1.2"
    folder.mkdir(parents=True)
    for file in model_dir.iterdir():  # link the big weights, copy the rest
        if file.suffix == ".safetensors":
            (folder / file.name).symlink_to(file)
        else:
            (folder / file.name).write_bytes(file.read_bytes())
    data = bytearray((folder / "tokenizer.json").read_bytes())
    data[100] ^= 0x01
    (folder / "tokenizer.json").write_bytes(bytes(data))
    return tmp_path


async def test_tampered_model_is_refused(tampered_store: Path) -> None:
    config = TokenizerConfig(port=0, metrics_port=0, model_store=str(tampered_store))
    with pytest.raises(ModelStoreError, match="tokenizer.json does not match its manifest"):
        await create_server(config)
    with pytest.raises(ModelStoreError, match="not in the store"):
        await create_server(TokenizerConfig(port=0, metrics_port=0,
                                            model_store=str(tampered_store / "empty")))


async def test_main_exits_2_on_a_missing_model(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.tokenizer", "--port", "0", "--metrics-port", "0",
        "--model-store", str(tmp_path), cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(), TIMEOUT_S * 3)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "not in the store" in lines[0]


async def test_module_serves_until_sigterm(store: ModelStore) -> None:
    env = {**os.environ, "AISERVE_MODEL_STORE": str(store.root)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.tokenizer", "--port", "0", "--metrics-port", "0",
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE)
    try:
        port = await asyncio.wait_for(_serving_port(proc), TIMEOUT_S * 3)
        await wait_for_serving(f"127.0.0.1:{port}", TIMEOUT_S)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _serving_port(proc: asyncio.subprocess.Process) -> int:
    """The port from the service's "serving" log line (a JSON object per line on stdout)."""
    assert proc.stdout is not None
    async for line in proc.stdout:
        event = json.loads(line) if line.startswith(b"{") else {}
        if event.get("event") == "serving":
            return int(event["port"])
    raise AssertionError("the service exited before serving")
