"""Each bad input gets its status code (docs/architecture.md, "Status codes"), and the suite keeps serving."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.server import wait_for_serving
from aiserve.store import ModelRef, ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.server import create_server
from suite.runner import Suite
from tests.integration.conftest import auth, config_for_tests, dev_key
from tests.integration.test_e2e import TIMEOUT_S, chat_request, complete


async def expect_code(address: str, request: gateway_pb2.GenerateRequest, code: grpc.StatusCode, key: str) -> str:
    async with aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            await gateway_pb2_grpc.GatewayStub(channel).Complete(request, metadata=auth(key), timeout=TIMEOUT_S)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


async def still_serving(suite: Suite) -> None:
    reply = await complete(suite, chat_request("Say hi.", max_new_tokens=4, cache=gateway_pb2.CACHE_POLICY_BYPASS))
    assert reply.usage.completion_tokens > 0


def _bad(**sampling: object) -> gateway_pb2.GenerateRequest:
    request = chat_request("hello")
    for key, value in sampling.items():
        if key == "stop":
            request.sampling.stop.extend(value)  # type: ignore[arg-type]
        else:
            setattr(request.sampling, key, value)
    return request


@pytest.mark.parametrize(
    ("request_factory", "needle"),
    [
        (lambda: gateway_pb2.GenerateRequest(), "input"),
        (lambda: gateway_pb2.GenerateRequest(prompt=""), "prompt: must not be empty"),
        (lambda: chat_request(""), "chat.messages[0].content"),
        (lambda: _bad(temperature=5.0), "sampling.temperature"),
        (lambda: _bad(top_p=0.0), "sampling.top_p"),
        (lambda: _bad(max_new_tokens=100_000), "sampling.max_new_tokens"),
        (lambda: _bad(preset="wild"), "sampling.preset"),
        (lambda: _bad(stop=["a", "b", "c", "d", "e"]), "sampling.stop"),
    ],
)
async def test_invalid_argument_names_the_field(suite: Suite, request_factory: object, needle: str) -> None:
    details = await expect_code(
        suite.config.address("gateway"),
        request_factory(),
        grpc.StatusCode.INVALID_ARGUMENT,
        dev_key(suite),  # type: ignore[operator]
    )
    assert needle in details


async def test_prompt_over_the_context_is_refused_or_truncated_when_asked(suite: Suite) -> None:
    long_prompt = "word " * 9000  # ~9,000 tokens > the served context (min(model 8192, max_seq_len 2048))
    request = gateway_pb2.GenerateRequest(prompt=long_prompt, sampling=common_pb2.SamplingParams(max_new_tokens=2))
    details = await expect_code(
        suite.config.address("gateway"), request, grpc.StatusCode.INVALID_ARGUMENT, dev_key(suite)
    )
    assert "prompt" in details and "2048" in details
    request.truncation = gateway_pb2.TRUNCATION_LEFT
    request.cache = gateway_pb2.CACHE_POLICY_BYPASS
    reply = await complete(suite, request)
    assert reply.usage.prompt_tokens == 2046 and reply.usage.completion_tokens > 0
    await still_serving(suite)


async def test_unknown_model_is_not_found(suite: Suite) -> None:
    request = chat_request("hello", model="nope@1")
    details = await expect_code(suite.config.address("gateway"), request, grpc.StatusCode.NOT_FOUND, dev_key(suite))
    assert "nope@1" in details
    await still_serving(suite)


def _copy_model(store: ModelStore, ref: ModelRef, dest_root: Path) -> Path:
    """A copy of the model in another store; the big weights file is hard-linked, never written."""
    src = store.path(ref)
    dest = dest_root / ref.name / ref.version
    dest.mkdir(parents=True)
    for file in src.iterdir():
        if file.name == "model.safetensors":
            try:
                os.link(file, dest / file.name)
            except OSError:
                shutil.copy2(file, dest / file.name)
        else:
            shutil.copy2(file, dest / file.name)
    return dest


@pytest.fixture
async def other_tokenizer(tmp_path: Path, store: ModelStore, model_ref: ModelRef) -> AsyncIterator[str]:
    """A tokenizer service for the same name@version whose tokenizer file differs (re-serialised)."""
    other = tmp_path / "store"
    folder = _copy_model(store, model_ref, tmp_path / "staging")
    tokenizer_json = folder / "tokenizer.json"
    tokenizer_json.write_text(json.dumps(json.loads(tokenizer_json.read_text()), indent=1))
    (folder / "manifest.json").unlink()
    ModelStore(other).install(model_ref, folder, {"test": "re-serialised tokenizer"})
    config = config_for_tests(tmp_path / "home", other)
    side = Suite(config)
    side.start_service("tokenizer")
    try:
        await side.wait_serving(("tokenizer",), timeout_s=120)
        yield config.address("tokenizer")
    finally:
        side.stop()


async def test_tokenizer_and_model_fingerprints_must_match(suite: Suite, other_tokenizer: str, tmp_path: Path) -> None:
    config = GatewayConfig(
        port=0,
        http_port=-1,
        metrics_port=0,
        tokenizer_address=other_tokenizer,
        inference_address=suite.config.address("inference"),
        cache_address="",
        keys_path=str(suite.config.home / "keys.sqlite3"),  # the suite's keys: its dev key works here too
        ledger_path=str(tmp_path / "ledger.sqlite3"),
        routes_path=str(tmp_path / "routes.sqlite3"),
    )
    handle = await create_server(config)
    await handle.start()
    try:
        details = await expect_code(
            f"127.0.0.1:{handle.port}", chat_request("hello"), grpc.StatusCode.FAILED_PRECONDITION, dev_key(suite)
        )
        assert "tokenizer sha256" in details
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{handle.extra_ports[0]}/v1", api_key=dev_key(suite),
                                      max_retries=0, timeout=120) as api:  # the HTTP door says it too: 412
            with pytest.raises(openai.APIStatusError) as info:
                await api.chat.completions.create(model="", messages=[{"role": "user", "content": "hello"}])
        assert info.value.status_code == 412 and "tokenizer sha256" in info.value.message
    finally:
        await handle.stop(0)
    await still_serving(suite)


async def test_tampered_model_file_makes_the_service_refuse_to_start(
    tmp_path: Path, store: ModelStore, model_ref: ModelRef
) -> None:
    folder = _copy_model(store, model_ref, tmp_path / "store")
    config_json = folder / "config.json"
    config_json.write_text(config_json.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 29'))
    config = config_for_tests(tmp_path / "home", tmp_path / "store")
    side = Suite(config)
    try:
        for service in ("tokenizer", "inference"):
            side.start_service(service)
            with pytest.raises(RuntimeError) as info:
                await side.wait_serving((service,), timeout_s=120)
            assert "config.json does not match its manifest" in str(info.value)
            assert side.processes[service].returncode == 2
    finally:
        side.stop()


async def test_inference_down_is_unavailable_and_the_suite_recovers(suite: Suite) -> None:
    suite.stop_service("inference")
    try:
        request = chat_request("hello", cache=gateway_pb2.CACHE_POLICY_BYPASS)
        details = await expect_code(
            suite.config.address("gateway"), request, grpc.StatusCode.UNAVAILABLE, dev_key(suite)
        )
        assert "unavailable" in details or "did not answer" in details
        async with aio.insecure_channel(suite.config.address("gateway")) as channel:  # it answers, NOT_SERVING
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        suite.start_service("inference")
        await suite.wait_serving(("inference",), timeout_s=300)
    await wait_for_serving(suite.config.address("gateway"), 10)  # SERVING again, from its watch of inference
    await still_serving(suite)
