"""The public API's pb <-> domain: what a client sends becomes a validated request, and the
pipeline's chunks and final become the messages a client reads."""

from __future__ import annotations

import pytest

from aiserve.common.errors import InvalidArgument
from aiserve.common.finish import FinishReason
from aiserve.v1 import common_pb2, gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.domain import Chunk, Final, TokenCount, TokenCountRequest, UsageRecord
from services.gateway.ledger import Bucket, Totals
from services.gateway.messages import (
    chunk_to_pb,
    complete_to_pb,
    count_request_from_pb,
    count_to_pb,
    final_to_pb,
    request_from_pb,
    usage_response_to_pb,
)

CONFIG = GatewayConfig(default_max_new_tokens=64)
USAGE = UsageRecord(3, 2, False, 1, 2, 3, "m@1", 90, cache_similarity=0.5, compute_ms=40)


def chat(*messages: tuple[str, str]) -> common_pb2.Chat:
    return common_pb2.Chat(messages=[common_pb2.Message(role=r, content=c) for r, c in messages])


def test_a_prompt_request_with_defaults() -> None:
    req = request_from_pb(gateway_pb2.GenerateRequest(prompt="Hello"), CONFIG, "rid")
    assert (req.request_id, req.prompt, req.messages, req.model) == ("rid", "Hello", None, "")
    assert (req.cache_policy, req.personalized, req.truncate_left, req.cache_min_similarity) == (
        "use", False, False, None)
    assert (req.sampling.temperature, req.sampling.max_new_tokens, req.sampling.seed) == (0.0, 64, None)


def test_a_chat_request_with_every_field_set() -> None:
    request = gateway_pb2.GenerateRequest(
        chat=chat(("system", "be brief"), ("user", "hi")), model="m@1", cache=gateway_pb2.CACHE_POLICY_REFRESH,
        personalized=True, truncation=gateway_pb2.TRUNCATION_LEFT, cache_min_similarity=0.9,
        sampling=common_pb2.SamplingParams(temperature=0.0, top_k=5, max_new_tokens=7, stop=["\n"], seed=3),
    )
    req = request_from_pb(request, CONFIG, "rid")
    assert req.prompt is None and req.messages == (("system", "be brief"), ("user", "hi"))
    assert (req.model, req.cache_policy, req.personalized, req.truncate_left) == ("m@1", "refresh", True, True)
    assert req.cache_min_similarity == pytest.approx(0.9)
    s = req.sampling
    assert (s.top_k, s.max_new_tokens, s.stop, s.seed) == (5, 7, ("\n",), 3)
    bypass = request_from_pb(gateway_pb2.GenerateRequest(prompt="x", cache=gateway_pb2.CACHE_POLICY_BYPASS),
                             CONFIG, "rid")
    assert bypass.cache_policy == "bypass"


def test_logprobs_options_are_carried_only_when_enabled() -> None:
    assert request_from_pb(gateway_pb2.GenerateRequest(prompt="x"), CONFIG, "rid").logprobs is None
    asked = request_from_pb(gateway_pb2.GenerateRequest(
        prompt="x", logprobs=gateway_pb2.LogprobsOptions(enabled=True, top_logprobs=20)), CONFIG, "rid")
    assert asked.logprobs is not None and asked.logprobs.top == 20


@pytest.mark.parametrize(("bad", "field"), [
    (gateway_pb2.GenerateRequest(), "input"),
    (gateway_pb2.GenerateRequest(prompt=""), "prompt"),
    (gateway_pb2.GenerateRequest(chat=chat(("robot", "hi"))), "chat.messages[0].role"),
    (gateway_pb2.GenerateRequest(prompt="x", cache_min_similarity=1.5), "cache_min_similarity"),
    (gateway_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(max_new_tokens=0)),
     "sampling.max_new_tokens"),
    (gateway_pb2.GenerateRequest(prompt="x", logprobs=gateway_pb2.LogprobsOptions(enabled=True, top_logprobs=21)),
     "logprobs.top_logprobs"),
    (gateway_pb2.GenerateRequest(prompt="x", logprobs=gateway_pb2.LogprobsOptions(top_logprobs=2)),
     "logprobs.top_logprobs"),
], ids=["no-input", "empty-prompt", "bad-role", "min-similarity", "max-new-tokens", "top-logprobs-over-20",
        "top-logprobs-without-enabled"])
def test_a_bad_request_names_its_field(bad: gateway_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        request_from_pb(bad, CONFIG, "rid")
    assert info.value.message.startswith(field)


def test_count_tokens_in_and_out() -> None:
    count = count_request_from_pb(common_pb2.CountTokensRequest(chat=chat(("user", "hi")), model="m@1"), CONFIG)
    assert count == TokenCountRequest(None, (("user", "hi"),), "m@1")
    with pytest.raises(InvalidArgument, match="input"):
        count_request_from_pb(common_pb2.CountTokensRequest(), CONFIG)
    reply = count_to_pb(TokenCount(12, 2048, "m@1"), "rid")
    assert (reply.token_count, reply.context_length, reply.model, reply.request_id) == (12, 2048, "m@1", "rid")


def test_chunks_and_the_final_as_streamed_and_as_one_answer() -> None:
    chunks = [Chunk("Hel", (1,)), Chunk("lo", (2, 3))]
    final = Final(FinishReason.LENGTH, USAGE)
    streamed = chunk_to_pb(chunks[1], "rid")
    assert (streamed.request_id, streamed.text_delta, list(streamed.token_ids)) == ("rid", "lo", [2, 3])
    assert not streamed.HasField("usage") and streamed.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    last = final_to_pb(final, "rid")
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.text_delta == ""
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cost_micros) == (3, 2, 90)
    assert (last.usage.queue_ms, last.usage.ttft_ms, last.usage.total_ms, last.usage.model) == (1, 2, 3, "m@1")
    assert last.usage.cache_similarity == pytest.approx(0.5)
    whole = complete_to_pb(chunks, final, "rid")
    assert (whole.text, list(whole.token_ids), whole.request_id) == ("Hello", [1, 2, 3], "rid")
    assert whole.finish_reason == common_pb2.FINISH_REASON_LENGTH and whole.usage == last.usage


def test_usage_totals_and_buckets() -> None:
    reply = usage_response_to_pb("acme", Totals(2, 20, 10, 107), [Bucket("2025-01-15", "m@1", Totals(1, 10, 5, 100))],
                                 "rid")
    assert (reply.tenant, reply.request_id, reply.total.requests, reply.total.cost_micros) == ("acme", "rid", 2, 107)
    [bucket] = reply.buckets
    assert (bucket.day, bucket.model, bucket.totals.prompt_tokens) == ("2025-01-15", "m@1", 10)
