"""End to end through the public gateway, exactly as a client calls it."""

from __future__ import annotations

import pytest
from grpc import aio

from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from suite.runner import Suite
from tests.integration.conftest import auth, dev_key, log_records, new_request_id

TIMEOUT_S = 120


def chat_request(text: str, max_new_tokens: int = 32, **kwargs: object) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens),
        **kwargs,  # type: ignore[arg-type]
    )
    request.chat.messages.add(role="user", content=text)
    return request


async def stream(
    suite: Suite, request: gateway_pb2.GenerateRequest, request_id: str | None = None, key: str | None = None
) -> tuple[list[gateway_pb2.GenerateResponse], dict[str, str]]:
    """Generate as a client would, with ``key`` (default: the suite's development key)."""
    metadata = auth(key or dev_key(suite)) + ((("x-request-id", request_id),) if request_id else ())
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=TIMEOUT_S, metadata=metadata)
        messages = [message async for message in call]
        return messages, dict(await call.initial_metadata())


async def complete(
    suite: Suite, request: gateway_pb2.GenerateRequest, key: str | None = None, request_id: str | None = None
) -> gateway_pb2.CompleteResponse:
    metadata = auth(key or dev_key(suite)) + ((("x-request-id", request_id),) if request_id else ())
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        return await gateway_pb2_grpc.GatewayStub(channel).Complete(request, metadata=metadata, timeout=TIMEOUT_S)


async def test_greedy_chat_answer_mentions_paris(suite: Suite) -> None:
    reply = await complete(suite, chat_request("What is the capital of France?", cache=gateway_pb2.CACHE_POLICY_BYPASS))
    assert "Paris" in reply.text
    assert reply.usage.completion_tokens == len(reply.token_ids) > 0
    assert reply.usage.prompt_tokens > 10 and reply.usage.model == "smollm2-135m-instruct@0.1.2"
    assert reply.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert reply.usage.cost_micros > 0 and not reply.usage.cache_hit


async def test_one_request_id_travels_through_all_four_services(suite: Suite) -> None:
    request_id = new_request_id()
    request = chat_request("Name a colour.", max_new_tokens=8, cache=gateway_pb2.CACHE_POLICY_REFRESH)
    messages, metadata = await stream(suite, request, request_id)
    assert metadata["x-request-id"] == request_id
    assert messages and all(m.request_id == request_id for m in messages)
    assert messages[-1].HasField("usage")
    for service in ("gateway", "tokenizer", "inference", "cache"):
        tagged = [r for r in log_records(suite, service) if r.get("request_id") == request_id]
        assert tagged, f"no log line of {service} carries request id {request_id}"
        assert all(r["service"] == service for r in tagged)


async def test_chinese_prompt_streams_without_replacement_characters(suite: Suite) -> None:
    request = chat_request("请用中文介绍一下北京。", max_new_tokens=48, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    messages, _ = await stream(suite, request)
    deltas = [m.text_delta for m in messages]
    assert all("\ufffd" not in d for d in deltas)
    text = "".join(deltas)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text
    assert len([d for d in deltas if d]) > 3  # it really streamed


async def test_second_identical_greedy_request_is_a_cache_hit(suite: Suite) -> None:
    request = chat_request("Give me one word that rhymes with cat.", max_new_tokens=12)
    first, _ = await stream(suite, request)
    second, _ = await stream(suite, request)
    assert not first[-1].usage.cache_hit
    assert second[-1].usage.cache_hit and second[-1].usage.cache_similarity == pytest.approx(1.0)
    assert "".join(m.text_delta for m in second) == "".join(m.text_delta for m in first)
    assert second[-1].usage.completion_tokens == first[-1].usage.completion_tokens
    # A personalized request is never answered from the cache.
    personal, _ = await stream(suite, chat_request("Give me one word that rhymes with cat.", 12, personalized=True))
    assert not personal[-1].usage.cache_hit


async def test_stop_string_ends_the_answer_without_returning_it(suite: Suite) -> None:
    base = chat_request(
        "Count from 1 to 20, separated by commas.", max_new_tokens=64, cache=gateway_pb2.CACHE_POLICY_BYPASS
    )
    full = await complete(suite, base)
    assert "5" in full.text
    base.sampling.stop.append("5")
    cut = await complete(suite, base)
    assert "5" not in cut.text and full.text.startswith(cut.text)
    assert cut.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_count_tokens(suite: Suite) -> None:
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).CountTokens(
            common_pb2.CountTokensRequest(prompt="Hello world"), metadata=auth(dev_key(suite)), timeout=TIMEOUT_S
        )
    # what the engine accepts: min(model context 8192, inference max_seq_len 2048)
    assert reply.token_count == 2 and reply.context_length == 2048
    assert reply.model == "smollm2-135m-instruct@0.1.2" and reply.request_id
