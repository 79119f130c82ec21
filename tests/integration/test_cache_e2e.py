"""The semantic cache end to end, through the public gateway exactly as a client calls it.

Every test uses its own questions: the suite (and its cache) is shared by the whole session.
"""

from __future__ import annotations

import grpc
from grpc import aio

from aiserve.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from suite.runner import Suite
from tests.integration.conftest import (
    auth,
    create_tenant,
    dev_key,
    eventually,
    ledger_rows,
    log_records,
    new_request_id,
)
from tests.integration.test_e2e import TIMEOUT_S, chat_request, stream

USE, REFRESH = gateway_pb2.CACHE_POLICY_USE, gateway_pb2.CACHE_POLICY_REFRESH


def text_of(messages: list[gateway_pb2.GenerateResponse]) -> str:
    return "".join(m.text_delta for m in messages)


async def threshold(suite: Suite) -> float:
    async with aio.insecure_channel(suite.config.address("cache")) as channel:
        info = await cache_pb2_grpc.CacheStub(channel).Info(cache_pb2.CacheInfoRequest(), timeout=TIMEOUT_S)
    return float(info.similarity_threshold)


async def test_a_paraphrase_is_answered_by_meaning_in_one_message(suite: Suite) -> None:
    first, _ = await stream(suite, chat_request("Which planet is known as the Red Planet?", 24))
    assert not first[-1].usage.cache_hit and first[-1].usage.cost_micros > 0
    hit, _ = await stream(suite, chat_request("What planet is called the Red Planet?", 24))
    usage = hit[-1].usage
    assert usage.cache_hit and usage.cost_micros == 0
    assert await threshold(suite) <= usage.cache_similarity < 1.0
    assert text_of(hit) == text_of(first) and usage.completion_tokens == first[-1].usage.completion_tokens
    # The whole answer in one message (the first was streamed over several), then the final one.
    assert len(first) > 3 and len(hit) == 2 and hit[0].text_delta
    assert [t for m in hit for t in m.token_ids] == [t for m in first for t in m.token_ids]
    assert hit[-1].finish_reason == first[-1].finish_reason


async def test_another_fact_a_stricter_threshold_another_system_prompt_all_miss(suite: Suite) -> None:
    stored, _ = await stream(suite, chat_request("How many legs does an insect have?", 16))
    assert not stored[-1].usage.cache_hit
    other_fact, _ = await stream(suite, chat_request("How many legs does a spider have?", 16))
    assert not other_fact[-1].usage.cache_hit
    paraphrase, _ = await stream(suite, chat_request("How many legs do insects have?", 16))
    assert paraphrase[-1].usage.cache_hit and text_of(paraphrase) == text_of(stored)
    strict, _ = await stream(suite, chat_request("How many legs do insects have?", 16, cache_min_similarity=0.999))
    assert not strict[-1].usage.cache_hit
    with_system = chat_request("How many legs does an insect have?", 16)
    with_system.chat.messages.insert(0, common_pb2.Message(role="system", content="Answer in one word."))
    system, _ = await stream(suite, with_system)
    assert not system[-1].usage.cache_hit


async def test_a_tenant_never_receives_another_tenants_answer(suite: Suite) -> None:
    question = chat_request("Who wrote the play Macbeth?", 16)
    mine, _ = await stream(suite, question)
    assert not mine[-1].usage.cache_hit
    assert (await stream(suite, question))[0][-1].usage.cache_hit
    _, other_key = create_tenant(suite.config.home, "cache-e2e")
    theirs, _ = await stream(suite, question, key=other_key)
    assert not theirs[-1].usage.cache_hit


async def test_sampled_requests_are_never_cached_and_refresh_stores_without_lookup(suite: Suite) -> None:
    sampled = chat_request("Name a fruit that is yellow.", 12)
    sampled.sampling.temperature, sampled.sampling.seed = 0.7, 42
    for _ in range(2):
        reply, _ = await stream(suite, sampled)
        assert not reply[-1].usage.cache_hit

    question = chat_request("Name a fruit that is red.", 12)
    await stream(suite, question)
    question.cache = REFRESH
    refreshed, _ = await stream(suite, question)
    assert not refreshed[-1].usage.cache_hit  # never looked up ...
    question.cache = USE
    again, _ = await stream(suite, question)
    assert again[-1].usage.cache_hit and text_of(again) == text_of(refreshed)  # ... but stored


async def test_a_cancelled_generation_leaves_nothing_in_the_cache(suite: Suite) -> None:
    question = chat_request("Write a long story about a lighthouse keeper.", 64)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(question, timeout=TIMEOUT_S, metadata=auth(dev_key(suite)))
        async for message in call:
            if message.text_delta:
                break  # the client leaves after the first words
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
    after, _ = await stream(suite, question)
    assert not after[-1].usage.cache_hit


async def inference_stats(suite: Suite) -> inference_pb2.InferenceStats:
    async with aio.insecure_channel(suite.config.address("inference")) as channel:
        return await inference_pb2_grpc.InferenceStub(channel).Stats(inference_pb2.InferenceStatsRequest(),
                                                                     timeout=TIMEOUT_S)


def logged(suite: Suite, service: str, event: str, request_id: str, **fields: object) -> bool:
    """Whether ``service`` has logged ``event`` for ``request_id`` (with these field values)."""
    return any(r.get("event") == event and r.get("request_id") == request_id
               and all(r.get(k) == v for k, v in fields.items()) for r in log_records(suite, service))


async def test_a_hit_by_meaning_cancels_the_generation_it_raced_and_costs_nothing(suite: Suite) -> None:
    first, _ = await stream(suite, chat_request("Who invented the telephone?", 24))
    assert not first[-1].usage.cache_hit
    before = await inference_stats(suite)
    request_id = new_request_id()
    hit, _ = await stream(suite, chat_request("Who was the inventor of the telephone?", 24), request_id=request_id)
    usage = hit[-1].usage
    assert usage.cache_hit and usage.cost_micros == 0 and text_of(hit) == text_of(first)
    # The generation was started while the cache embedded the question ...
    assert (await inference_stats(suite)).num_requests == before.num_requests + 1
    # ... and cancelled under the request's id once the cache answered (before its first token).
    await eventually(lambda: logged(suite, "inference", "rpc", request_id, code="CANCELLED"),
                     what="the inference service's line for the cancelled generation")
    await eventually(lambda: logged(suite, "gateway", "generation_cancelled_for_cache_hit", request_id),
                     what="the gateway's line for the cancelled generation")
    # One ledger row: a hit, billed nothing, the cached answer's tokens.
    [row] = [r for r in ledger_rows(suite.config.home) if r.request_id == request_id]
    assert (row.status, row.cache_hit, row.cost_micros) == ("OK", True, 0)
    assert row.completion_tokens == usage.completion_tokens == first[-1].usage.completion_tokens
