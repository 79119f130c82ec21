"""OpenAI request bodies -> the gateway's GenerateRequest (docs/http.md).

The HTTP door's only conversion on the way in: a chat or completions body is checked for its
shape and types here (a 400 naming the parameter), then becomes the same ``GenerateRequest``
the gRPC API takes, so that the gateway's own validation (``messages.py``, ``validation.py``)
checks the ranges for both doors alike. A parameter aiserve does not implement is refused,
never ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiserve.common.errors import InvalidArgument
from aiserve.v1 import common_pb2, gateway_pb2

MAX_TOP_LOGPROBS = 20
"""Alternatives per token a chat request may ask for (``top_logprobs``)."""
MAX_COMPLETION_LOGPROBS = 5
"""Alternatives per token a completions request may ask for (``logprobs``), as OpenAI allows."""
MAX_USER_CHARS = 256
"""Longest ``user`` value (it goes into the ledger row)."""
_MAX_SEED = (1 << 64) - 1

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                     "response_format", "user", "top_k", "repetition_penalty"})
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
"""Every chat parameter aiserve honours (``top_k`` and ``repetition_penalty`` are its own)."""
COMPLETION_PARAMS = _COMMON | {"prompt", "logprobs"}
"""Every completions parameter aiserve honours."""
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,),
    "parallel_tool_calls": (True, False), "store": (False,),
}
"""Parameters aiserve does not implement, accepted only at the value that changes nothing."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""OpenAI's chat roles -> the model's (``developer`` is the newer name of ``system``)."""


class ParamError(InvalidArgument):
    """A 400 that names the OpenAI parameter it is about."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A checked chat or completions request: the gateway request of its first choice, and
    what the HTTP door does around it."""

    request: gateway_pb2.GenerateRequest
    is_chat: bool
    model: str
    """As the client named it ("" = the default route)."""
    n: int
    """Choices: each one its own generation (its own sequence in the batch and its own row)."""
    stream: bool
    include_usage: bool
    user: str
    top_logprobs: int | None
    """None: no log-probabilities; else the alternatives per token (0 = the token's own only)."""

    def choice(self, index: int) -> gateway_pb2.GenerateRequest:
        """The request of choice ``index``: with a seed, choice i samples with seed + i (so that
        n seeded choices differ, and the same request gets the same n answers)."""
        if index == 0 or not self.request.sampling.HasField("seed"):
            return self.request
        other = gateway_pb2.GenerateRequest()
        other.CopyFrom(self.request)
        other.sampling.seed = (self.request.sampling.seed + index) & _MAX_SEED
        return other


def cache_policy(cache_control: str) -> gateway_pb2.CachePolicy:
    """A request's ``Cache-Control`` header as the gateway's cache policy: ``no-store`` neither
    looks up nor stores (``CACHE_POLICY_BYPASS``; the gateway has no policy that looks up without
    storing), ``no-cache`` never answers from the cache but stores the new answer
    (``CACHE_POLICY_REFRESH``), and anything else uses the cache. Directive names are
    case-insensitive, and the others are ignored, as HTTP asks of a cache."""
    directives = {d.split("=", 1)[0].strip().lower() for d in cache_control.split(",")}
    if "no-store" in directives:
        return gateway_pb2.CACHE_POLICY_BYPASS
    if "no-cache" in directives:
        return gateway_pb2.CACHE_POLICY_REFRESH
    return gateway_pb2.CACHE_POLICY_USE


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"body: must be a JSON object, got {type(body).__name__}")
    return body


def chat_request(body: Mapping[str, Any], max_choices: int) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body, checked."""
    given = _given(body, CHAT_PARAMS)
    request = gateway_pb2.GenerateRequest(chat=common_pb2.Chat(messages=_messages(given.get("messages"))))
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise ParamError("max_completion_tokens", "set either max_tokens or max_completion_tokens, not both")
    limit = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    top: int | None = None
    if _flag(given, "logprobs"):
        top = _integer(given, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif given.get("top_logprobs"):
        raise ParamError("top_logprobs", "requires logprobs: true")
    return _finish(request, given, limit, max_choices, top, is_chat=True)


def completion_request(body: Mapping[str, Any], max_choices: int) -> OpenAIRequest:
    """A ``POST /v1/completions`` body, checked (one prompt string per request)."""
    given = _given(body, COMPLETION_PARAMS)
    prompt = given.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ParamError("prompt", "must be a string (or a list of exactly one string)")
    request = gateway_pb2.GenerateRequest(prompt=prompt)
    top = _integer(given, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return _finish(request, given, "max_tokens", max_choices, top, is_chat=False)


def _finish(request: gateway_pb2.GenerateRequest, given: Mapping[str, Any], limit: str, max_choices: int,
            top: int | None, *, is_chat: bool) -> OpenAIRequest:
    """The parameters both endpoints share, onto ``request``."""
    model = _text(given, "model", 256)
    request.model = model
    _sampling(request.sampling, given, limit)
    if top is not None:
        request.logprobs.enabled = True
        request.logprobs.top_logprobs = top
    if (fmt := given.get("response_format")) is not None:
        _response_format(request.response_format, fmt)
    stream = _flag(given, "stream")
    options = given.get("stream_options")
    if options is not None and not stream:
        raise ParamError("stream_options", "only allowed with stream: true")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ParamError("stream_options", "must be an object with only include_usage")
    include_usage = bool(options and _flag(options, "include_usage", "stream_options.include_usage"))
    n = _integer(given, "n", 1, max_choices)
    return OpenAIRequest(request, is_chat, model, 1 if n is None else n, stream, include_usage,
                         _text(given, "user", MAX_USER_CHARS), top)


def _given(body: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """The body's parameters that are set (null = not set); a 400 for any aiserve does not honour."""
    given = {key: value for key, value in body.items() if value is not None}
    for key, value in given.items():
        if key in known:
            continue
        if key in _NEUTRAL and any(value == v and type(value) is type(v) for v in _NEUTRAL[key]):
            continue
        raise ParamError(key, "not supported by aiserve" + (f" (only {_NEUTRAL[key][0]!r} is accepted)"
                                                            if key in _NEUTRAL else ""))
    return {key: value for key, value in given.items() if key in known}


def _messages(value: Any) -> list[common_pb2.Message]:
    if not isinstance(value, list):
        raise ParamError("messages", "must be a list of messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ParamError(f"messages[{i}]", "must be an object with role and content")
        if extra := sorted(set(message) - {"role", "content"}):
            raise ParamError(f"messages[{i}].{extra[0]}", "not supported by aiserve")
        role = _ROLES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ParamError(f"messages[{i}].role", f"must be system, developer, user or assistant, "
                                                    f"got {message.get('role')!r}")
        out.append(common_pb2.Message(role=role, content=_content(message.get("content"), i)))
    return out


def _content(value: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ParamError(f"messages[{i}].content", "must be a string or a list of text parts "
                                               "(aiserve takes text only)")


def _sampling(sp: common_pb2.SamplingParams, given: Mapping[str, Any], limit: str) -> None:
    for name in ("temperature", "top_p", "repetition_penalty"):
        if (value := _number(given, name)) is not None:
            setattr(sp, name, value)
    if (top_k := _integer(given, "top_k", 0, 1_000_000)) is not None:
        sp.top_k = top_k
    if (max_tokens := _integer(given, limit, 1, 1 << 31)) is not None:
        sp.max_new_tokens = max_tokens
    if (seed := _integer(given, "seed", 0, _MAX_SEED)) is not None:
        sp.seed = seed
    stop = given.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise ParamError("stop", "must be a string or a list of strings")
    sp.stop.extend(stops or ())


def _response_format(fmt: gateway_pb2.ResponseFormat, value: Any) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        fmt.json_object.SetInParent()
        return
    if kind != "json_schema":
        raise ParamError("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                            "{\"type\": \"json_schema\", \"json_schema\": {...}}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ParamError("response_format.json_schema", "must be an object with name and schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ParamError("response_format.json_schema.schema", "must be a JSON Schema object")
    fmt.json_schema.name = _text(spec, "name", 256, "response_format.json_schema.name")
    fmt.json_schema.schema = json.dumps(schema)
    fmt.json_schema.strict = _flag(spec, "strict", "response_format.json_schema.strict")


def _number(given: Mapping[str, Any], name: str) -> float | None:
    value = given.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamError(name, f"must be a number, got {json.dumps(value)}")
    return float(value)


def _integer(given: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = given.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"must be an integer, got {json.dumps(value)}")
    if not low <= value <= high:
        raise ParamError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _flag(given: Mapping[str, Any], name: str, param: str = "") -> bool:
    value = given.get(name, False)
    if not isinstance(value, bool):
        raise ParamError(param or name, f"must be true or false, got {json.dumps(value)}")
    return value


def _text(given: Mapping[str, Any], name: str, max_chars: int, param: str = "") -> str:
    value = given.get(name, "")
    if not isinstance(value, str):
        raise ParamError(param or name, f"must be a string, got {json.dumps(value)}")
    if len(value) > max_chars:
        raise ParamError(param or name, f"at most {max_chars} characters, got {len(value)}")
    return value
