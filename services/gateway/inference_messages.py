"""pb <-> domain for the inference service's messages, as the gateway sends and reads them
(both ways of generating, ``generate_mux_client.py`` and ``generate_call_client.py``, use these).
"""

from __future__ import annotations

from aiserve.common.finish import FinishReason
from aiserve.common.pb_enums import finish_reason_from_pb
from aiserve.v1 import inference_pb2
from services.gateway.domain import EngineLogprob, GenerationEvent, GenerationRequest


def request_to_pb(request: GenerationRequest) -> inference_pb2.InferenceRequest:
    """domain -> pb: the request with its resolved decoding parameters."""
    s = request.sampling
    decoding = inference_pb2.Decoding(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        repetition_penalty=s.repetition_penalty, max_new_tokens=s.max_new_tokens,
    )
    if s.seed is not None:
        decoding.seed = s.seed
    if request.logprobs is not None:
        decoding.logprobs, decoding.top_logprobs = True, request.logprobs.top
    if request.response_format is not None:
        if request.response_format.schema:
            decoding.json_schema = request.response_format.schema
        else:
            decoding.json_object.SetInParent()
    return inference_pb2.InferenceRequest(
        request_id=request.request_id, model=request.model, prompt_token_ids=request.prompt_token_ids,
        decoding=decoding, priority=request.priority,
    )


def event_from_pb(message: inference_pb2.InferenceResponse) -> GenerationEvent:
    """pb -> domain. A finish reason this gateway does not know still ends the generation (as STOP)."""
    finish: FinishReason | None = None
    if message.finish_reason:
        finish = finish_reason_from_pb(message.finish_reason) or FinishReason.STOP
    return GenerationEvent(
        token_ids=tuple(message.token_ids), finish_reason=finish, queue_ms=message.queue_ms,
        compute_ms=message.compute_ms, kv_peak_bytes=message.kv_peak_bytes,
        logprobs=tuple(EngineLogprob(lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))
                       for lp in message.logprobs),
    )
