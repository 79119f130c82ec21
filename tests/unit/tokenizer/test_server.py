"""The tokenizer service over real gRPC sockets: the unary RPCs, their errors, metadata and start-up
(the streaming RPCs: test_server_streams.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc import aio

from aiserve.common.server import ServiceHandle, wait_for_serving
from aiserve.store import ModelStore, ModelStoreError
from aiserve.v1 import common_pb2, status_pb2, status_pb2_grpc, tokenizer_pb2
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import TokenizerServicer, create_server
from services.tokenizer.tokenizer import ChatMessage, ModelTokenizer
from suite.process import read_announced_port
from tests.unit.tokenizer.conftest import CHINESE, MODEL, TIMEOUT_S, Stub

# One server (conftest.py) and one event loop for the module.
pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO_ROOT = Path(__file__).resolve().parents[3]


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


async def test_status_names_the_model_it_serves(server: ServiceHandle) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        report = await status_pb2_grpc.StatusStub(channel).GetStatus(status_pb2.StatusRequest(), timeout=TIMEOUT_S)
    assert (report.service, report.model) == ("tokenizer", MODEL)
    assert (report.state, report.reason) == (status_pb2.SERVING_STATE_SERVING, "")


async def test_tokenize_and_detokenize(stub: Stub, tokenizer: ModelTokenizer) -> None:
    reply = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=CHINESE), timeout=TIMEOUT_S)
    assert list(reply.token_ids) == tokenizer.encode(CHINESE)
    back = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=reply.token_ids),
                                 timeout=TIMEOUT_S)
    assert back.text == CHINESE
    wrapped = tokenizer_pb2.DetokenizeRequest(token_ids=[1, *reply.token_ids, 2],
                                              skip_special_tokens=True)
    assert (await stub.Detokenize(wrapped, timeout=TIMEOUT_S)).text == CHINESE


async def test_token_bytes_spell_the_text_token_by_token(stub: Stub, tokenizer: ModelTokenizer) -> None:
    text = "Héllo 中文 world 🦙 饕餮"
    ids = [*tokenizer.encode(text), 2]  # 🦙 and 饕 are split over byte tokens: each holds part of a character
    reply = await stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=ids), timeout=TIMEOUT_S)
    pieces = list(reply.token_bytes)
    assert len(pieces) == len(ids)
    assert b"".join(pieces[:-1]).decode("utf-8") == text
    assert pieces[-1] == b"<|im_end|>"  # a special token is its text
    assert any(_is_partial(p) for p in pieces)
    await _expect_error(stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=[1 << 30]), timeout=TIMEOUT_S),
                        grpc.StatusCode.INVALID_ARGUMENT, "token_ids[0]")
    await _expect_error(stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=[0] * 4097), timeout=TIMEOUT_S),
                        grpc.StatusCode.INVALID_ARGUMENT, "at most 4096")


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


class _RecordingTokenizer:
    """Stands in for the servicer's tokenizer: records the thread of each ``encode`` and holds a
    large one until released, so a test can see what the event loop does meanwhile."""

    def __init__(self, real: ModelTokenizer) -> None:
        self._real = real
        self.threads: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def encode(self, text: str, add_special_tokens: bool = False, field: str = "text") -> list[int]:
        self.threads.append(threading.get_ident())
        if len(text) > 10_000:
            self.entered.set()
            self.release.wait(TIMEOUT_S)
        return self._real.encode(text, add_special_tokens, field)


async def test_large_input_runs_off_the_event_loop(server: ServiceHandle, stub: Stub, tokenizer: ModelTokenizer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    servicer = server.servicer
    assert isinstance(servicer, TokenizerServicer)
    recorder = _RecordingTokenizer(servicer.tokenizer)
    monkeypatch.setattr(servicer, "_tokenizer", recorder)
    loop_thread = threading.get_ident()  # the server runs on this test's event loop
    await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="A short text."), timeout=TIMEOUT_S)
    assert recorder.threads == [loop_thread]  # small inputs are tokenized inline

    text = "Long inputs leave the event loop. " * 1000  # > 10k characters: worker thread
    large = asyncio.ensure_future(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=TIMEOUT_S))
    try:
        assert await asyncio.to_thread(recorder.entered.wait, TIMEOUT_S), "the large call never reached encode"
        # While encode is held, the event loop still answers another call.
        info = await stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=TIMEOUT_S)
        assert info.model == MODEL and not large.done()
    finally:
        recorder.release.set()
    assert list((await large).token_ids) == tokenizer.encode(text)
    assert recorder.threads[1] != loop_thread
    back = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=(await large).token_ids),
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


async def test_module_announces_its_port_and_serves_until_sigterm(store: ModelStore) -> None:
    env = {**os.environ, "AISERVE_MODEL_STORE": str(store.root)}
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.tokenizer", "--port", "0", "--metrics-port", "0",
            "--announce-fd", str(write_fd), cwd=REPO_ROOT, env=env, pass_fds=(write_fd,),
            stdout=asyncio.subprocess.DEVNULL)
    finally:
        os.close(write_fd)
    try:
        port = await asyncio.wait_for(read_announced_port(read_fd), TIMEOUT_S * 3)
        assert port, "the service exited before it announced its port"
        await wait_for_serving(f"127.0.0.1:{port}", TIMEOUT_S)
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
