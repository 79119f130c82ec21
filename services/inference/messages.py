"""pb <-> domain for the engine's requests and events (Generate and GenerateMux share them)."""

from __future__ import annotations

from aiserve.common.context import current_request_id
from aiserve.common.errors import InvalidArgument
from aiserve.common.pb_enums import finish_reason_to_pb
from aiserve.v1 import inference_pb2
from services.inference.grammar import JsonConstraint
from services.inference.request import GenerateRequest, TokenEvent
from services.inference.sampler import SamplingParams


def from_pb(request: inference_pb2.InferenceRequest, deadline: float | None) -> GenerateRequest:
    """pb -> domain. proto3 zeros of top_p and repetition_penalty (unset) mean "off"."""
    d = request.decoding
    params = SamplingParams(
        temperature=d.temperature,
        top_p=d.top_p or 1.0,
        top_k=d.top_k,
        repetition_penalty=d.repetition_penalty or 1.0,
        seed=d.seed if d.HasField("seed") else None,
    )
    return GenerateRequest(
        request_id=request.request_id or current_request_id(),
        prompt_token_ids=tuple(request.prompt_token_ids),
        params=params,
        max_new_tokens=d.max_new_tokens,
        stop_token_ids=frozenset(d.stop_token_ids),
        ignore_eos=d.ignore_eos,
        priority=request.priority,
        deadline=deadline,
        top_logprobs=d.top_logprobs if d.logprobs else None,
        constraint=_constraint(d),
    )


def _constraint(d: inference_pb2.Decoding) -> JsonConstraint | None:
    """The oneof ``constraint``: any JSON object, a JSON Schema's text, or none."""
    kind = d.WhichOneof("constraint")
    if kind == "json_object":
        return JsonConstraint()
    if kind == "json_schema":
        if not d.json_schema:
            raise InvalidArgument("decoding.json_schema: must not be empty")
        return JsonConstraint(d.json_schema)
    return None


def to_pb(request_id: str, event: TokenEvent) -> inference_pb2.InferenceResponse:
    """domain -> pb; the counters (running totals) go on every message."""
    return inference_pb2.InferenceResponse(
        request_id=request_id, token_ids=event.token_ids,
        finish_reason=finish_reason_to_pb(event.finish_reason),
        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
        queue_ms=round(event.queue_ms), compute_ms=round(event.compute_ms), kv_peak_bytes=event.kv_peak_bytes,
        logprobs=[inference_pb2.TokenLogprobs(logprob=lp.logprob, top_token_ids=[i for i, _ in lp.top],
                                              top_logprobs=[v for _, v in lp.top]) for lp in event.logprobs],
    )
