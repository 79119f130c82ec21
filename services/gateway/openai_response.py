"""The gateway's GenerateResponses -> OpenAI's response and chunk shapes (docs/http.md).

The HTTP door's only conversion on the way out. Each choice is one generation: its
``GenerateResponse`` messages (text deltas, token log-probabilities, then the last one with
finish_reason and usage) become a chat or completions choice, whole or as stream chunks. The
usage object carries the gRPC ``Usage`` figures, cost included, beside OpenAI's three counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiserve.v1 import common_pb2, gateway_pb2

_FINISH: dict[int, str] = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
"""OpenAI's finish reasons: "stop" (end of sequence or a stop string), "length" (max_tokens or
the context). A cancelled or failed generation never reaches a response (it is an error)."""


def finish_reason(reason: int) -> str:
    return _FINISH.get(reason, "stop")


def usage_json(usages: Sequence[common_pb2.Usage]) -> dict[str, Any]:
    """OpenAI's usage over every choice's generation (each one is billed: the tokens and costs
    add up), with the gRPC ``Usage`` figures as aiserve's own fields."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "cost_micros": sum(u.cost_micros for u in usages),
        "cache_hit": all(u.cache_hit for u in usages) if usages else False,
        "cache_similarity": max((u.cache_similarity for u in usages), default=0.0),
        "queue_ms": max((u.queue_ms for u in usages), default=0),
        "ttft_ms": min((u.ttft_ms for u in usages), default=0),
        "total_ms": max((u.total_ms for u in usages), default=0),
        "model": usages[0].model if usages else "",
    }


def _top(t: gateway_pb2.TopLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}


def chat_logprobs(items: Sequence[gateway_pb2.TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``content``, one entry per token with its top alternatives."""
    return {"content": [{**_top(t), "top_logprobs": [_top(a) for a in t.top]} for t in items],  # type: ignore[arg-type]
            "refusal": None}


def completion_logprobs(items: Sequence[gateway_pb2.TokenLogprob], offset: int) -> dict[str, Any]:
    """Completions' ``logprobs``: parallel lists; ``text_offset`` counts characters from ``offset``."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in items], "text_offset": offsets}


@dataclass
class Choice:
    """One choice's generation as it came: its text, log-probabilities and last message."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[gateway_pb2.TokenLogprob] = field(default_factory=list)
    last: gateway_pb2.GenerateResponse | None = None

    def add(self, reply: gateway_pb2.GenerateResponse) -> None:
        self.parts.append(reply.text_delta)
        self.logprobs.extend(reply.logprobs)
        if reply.HasField("usage"):
            self.last = reply

    @property
    def usage(self) -> common_pb2.Usage:
        return self.last.usage if self.last is not None else common_pb2.Usage()

    @property
    def finish_reason(self) -> str:
        return finish_reason(self.last.finish_reason if self.last is not None else 0)


def _head(request_id: str, kind: str, created: int, model: str) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model}


def chat_completion(request_id: str, created: int, choices: Sequence[Choice], has_logprobs: bool) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    usages = [c.usage for c in choices]
    return {**_head(request_id, "chat.completion", created, usages[0].model), "system_fingerprint": None, "choices": [
        {"index": c.index, "message": {"role": "assistant", "content": "".join(c.parts), "refusal": None},
         "logprobs": chat_logprobs(c.logprobs) if has_logprobs else None, "finish_reason": c.finish_reason}
        for c in choices], "usage": usage_json(usages)}


def text_completion(request_id: str, created: int, choices: Sequence[Choice], has_logprobs: bool) -> dict[str, Any]:
    """A whole ``text_completion``."""
    usages = [c.usage for c in choices]
    return {**_head(request_id, "text_completion", created, usages[0].model), "system_fingerprint": None, "choices": [
        {"index": c.index, "text": "".join(c.parts), "finish_reason": c.finish_reason,
         "logprobs": completion_logprobs(c.logprobs, 0) if has_logprobs else None}
        for c in choices], "usage": usage_json(usages)}


class ChunkWriter:
    """The stream chunks of one request, one choice's reply at a time (``include_usage``: every
    chunk carries ``usage: null`` and ``usage_chunk`` makes the last one)."""

    def __init__(self, request_id: str, created: int, model: str, is_chat: bool, has_logprobs: bool,
                 include_usage: bool) -> None:
        self.head = _head(request_id, "chat.completion.chunk" if is_chat else "text_completion", created, model)
        self.is_chat, self.has_logprobs, self.include_usage = is_chat, has_logprobs, include_usage
        self._offsets: dict[int, int] = {}
        """Characters sent so far per choice (completions' text_offset)."""

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self.head, "system_fingerprint": None, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self, index: int) -> dict[str, Any]:
        """Chat's first chunk of a choice: the assistant's role, no text yet."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def reply(self, index: int, reply: gateway_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The chunk of one GenerateResponse (None: nothing to send, e.g. an empty delta)."""
        is_last = reply.HasField("usage")
        if not reply.text_delta and not reply.logprobs and not is_last:
            return None
        reason = finish_reason(reply.finish_reason) if is_last else None
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(reply.text_delta)
        if self.is_chat:
            delta = {"content": reply.text_delta} if reply.text_delta or not is_last else {}
            logprobs = chat_logprobs(reply.logprobs) if self.has_logprobs and reply.logprobs else None
            return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
        logprobs = completion_logprobs(reply.logprobs, offset) if self.has_logprobs and reply.logprobs else None
        return self._chunk({"index": index, "text": reply.text_delta, "logprobs": logprobs, "finish_reason": reason})

    def usage_chunk(self, usages: Sequence[common_pb2.Usage]) -> dict[str, Any]:
        """The one chunk after the choices end: no choices, the usage of them all."""
        return {**self.head, "system_fingerprint": None, "choices": [], "usage": usage_json(usages)}
