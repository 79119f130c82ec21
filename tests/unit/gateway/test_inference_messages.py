"""What the gateway sends the inference service and reads back, as domain values."""

from __future__ import annotations

import pytest

from aiserve.common.finish import FinishReason
from aiserve.v1 import common_pb2, inference_pb2
from services.gateway.domain import EngineLogprob, GenerationEvent, GenerationRequest
from services.gateway.inference_messages import event_from_pb, request_to_pb
from services.gateway.validation import LogprobsRequest, ResponseFormat, Sampling


def sampling(seed: int | None) -> Sampling:
    return Sampling(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, max_new_tokens=16, stop=("x",),
                    seed=seed)


def test_a_request_carries_its_decoding_and_a_seed_only_when_set() -> None:
    sent = request_to_pb(GenerationRequest("rid", "m@1", (5, 6), sampling(seed=7), priority=10))
    assert (sent.request_id, sent.model, list(sent.prompt_token_ids), sent.priority) == ("rid", "m@1", [5, 6], 10)
    d = sent.decoding
    assert (d.top_k, d.max_new_tokens, d.seed) == (40, 16, 7)
    assert (d.temperature, d.top_p, d.repetition_penalty) == pytest.approx((0.7, 0.9, 1.1))
    assert not request_to_pb(GenerationRequest("rid", "m@1", (5,), sampling(seed=None), 0)).decoding.HasField("seed")


def test_logprobs_and_the_response_format_are_sent_only_when_asked() -> None:
    plain = request_to_pb(GenerationRequest("rid", "m@1", (5,), sampling(seed=None), 0)).decoding
    assert (plain.logprobs, plain.top_logprobs, plain.WhichOneof("constraint")) == (False, 0, None)
    schema = '{"type":"object"}'
    asked = request_to_pb(GenerationRequest("rid", "m@1", (5,), sampling(seed=None), 0,
                                            LogprobsRequest(top=3), ResponseFormat(schema=schema))).decoding
    assert (asked.logprobs, asked.top_logprobs, asked.json_schema) == (True, 3, schema)
    as_json = request_to_pb(GenerationRequest("rid", "m@1", (5,), sampling(seed=None), 0,
                                              response_format=ResponseFormat())).decoding
    assert as_json.WhichOneof("constraint") == "json_object"


def test_an_event_has_a_finish_reason_only_on_the_last_message() -> None:
    running = event_from_pb(inference_pb2.InferenceResponse(token_ids=[1, 2], queue_ms=3))
    assert running == GenerationEvent((1, 2), None, queue_ms=3)
    last = event_from_pb(inference_pb2.InferenceResponse(
        token_ids=[9], finish_reason=common_pb2.FINISH_REASON_LENGTH, queue_ms=3, compute_ms=40, kv_peak_bytes=64))
    assert last == GenerationEvent((9,), FinishReason.LENGTH, queue_ms=3, compute_ms=40, kv_peak_bytes=64)
    unknown = inference_pb2.InferenceResponse(token_ids=[9])
    unknown.finish_reason = 99  # type: ignore[assignment]  # a reason added after this gateway was built
    assert event_from_pb(unknown).finish_reason == FinishReason.STOP  # still the last message


def test_an_events_logprobs_are_read_in_token_order() -> None:
    message = inference_pb2.InferenceResponse(token_ids=[5, 6], logprobs=[
        inference_pb2.TokenLogprobs(logprob=-0.5, top_token_ids=[5, 9], top_logprobs=[-0.5, -1.25]),
        inference_pb2.TokenLogprobs(logprob=-0.75)])
    event = event_from_pb(message)
    assert event.logprobs == (EngineLogprob(-0.5, ((5, -0.5), (9, -1.25))), EngineLogprob(-0.75, ()))
    assert event_from_pb(inference_pb2.InferenceResponse(token_ids=[5])).logprobs == ()
