"""Request validation and sampling resolution: presets, defaults, ranges (docs/gateway.md).

Every error names the field and its limit, and is INVALID_ARGUMENT. No grpc or pb here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime

from aiserve.common.errors import InvalidArgument
from aiserve.common.protocol import CHAT_ROLES
from services.gateway.config import GatewayConfig


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """What the client asked for; None = not set."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    preset: str = ""


@dataclass(frozen=True, slots=True)
class Sampling:
    """Fully resolved decoding parameters."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int | None

    def cache_key(self) -> str:
        """Canonical text of everything here that changes the answer (the cache scope)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


# Factual Q&A wants a low temperature with top-p 0.9; creative writing a higher
# temperature with a repetition penalty.
PRESETS: dict[str, dict[str, float]] = {
    "": {},
    "factual": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.0},
    "creative": {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1},
}
_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def _check_range(field: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    below = value <= low if low_open else value < low
    if below or value > high or value != value:  # value != value: NaN
        bracket = "(" if low_open else "["
        raise InvalidArgument(f"sampling.{field}: must be in {bracket}{low}, {high}], got {value}")


def resolve_sampling(given: SamplingInput, config: GatewayConfig) -> Sampling:
    """Preset < explicit fields; then defaults; then range checks."""
    if given.preset not in PRESETS:
        raise InvalidArgument(
            f"sampling.preset: unknown preset {given.preset!r}; known: factual, creative, or empty"
        )
    values: dict[str, float | int | None] = {**_DEFAULTS, **PRESETS[given.preset]}
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if (explicit := getattr(given, name)) is not None:
            values[name] = explicit
    max_new = given.max_new_tokens if given.max_new_tokens is not None else config.default_max_new_tokens
    _check_range("temperature", float(values["temperature"] or 0.0), 0.0, 2.0)
    _check_range("top_p", float(values["top_p"] or 0.0), 0.0, 1.0, low_open=True)
    _check_range("repetition_penalty", float(values["repetition_penalty"] or 0.0), 0.5, 2.0)
    if not 0 <= int(values["top_k"] or 0) <= 1_000_000:
        raise InvalidArgument(f"sampling.top_k: must be in [0, 1000000], got {values['top_k']}")
    if not 1 <= max_new <= config.max_new_tokens_limit:
        raise InvalidArgument(
            f"sampling.max_new_tokens: must be in [1, {config.max_new_tokens_limit}], got {max_new}"
        )
    if len(given.stop) > config.max_stop_strings:
        raise InvalidArgument(
            f"sampling.stop: at most {config.max_stop_strings} strings, got {len(given.stop)}"
        )
    for text in given.stop:
        if not 1 <= len(text) <= config.max_stop_chars:
            raise InvalidArgument(
                f"sampling.stop: each string must be 1..{config.max_stop_chars} characters, "
                f"got {len(text)}"
            )
    return Sampling(
        temperature=float(values["temperature"] or 0.0),
        top_p=float(values["top_p"] or 0.0),
        top_k=int(values["top_k"] or 0),
        repetition_penalty=float(values["repetition_penalty"] or 0.0),
        max_new_tokens=max_new,
        stop=given.stop,
        seed=given.seed,
    )


def validate_input(prompt: str | None, messages: Sequence[tuple[str, str]] | None, config: GatewayConfig) -> None:
    """Exactly one of prompt / chat; non-empty; within the character limits."""
    if prompt is None and messages is None:
        raise InvalidArgument("input: set either prompt or chat")
    if prompt is not None:
        if not prompt:
            raise InvalidArgument("prompt: must not be empty")
        if len(prompt) > config.max_prompt_chars:
            raise InvalidArgument(
                f"prompt: at most {config.max_prompt_chars} characters, got {len(prompt)}"
            )
        return
    assert messages is not None
    if not messages:
        raise InvalidArgument("chat.messages: must hold at least one message")
    if len(messages) > config.max_chat_messages:
        raise InvalidArgument(
            f"chat.messages: at most {config.max_chat_messages} messages, got {len(messages)}"
        )
    total = 0
    for i, (role, content) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"chat.messages[{i}].role: must be system, user or assistant, got {role!r}")
        if not content:
            raise InvalidArgument(f"chat.messages[{i}].content: must not be empty")
        total += len(content)
    if total > config.max_prompt_chars:
        raise InvalidArgument(f"chat.messages: at most {config.max_prompt_chars} characters in all, got {total}")


def fit_prompt(token_ids: Sequence[int], max_new_tokens: int, context_length: int, model: str,
               max_prompt_tokens: int, truncate_left: bool) -> Sequence[int]:
    """The context is a hard limit, and so is the max_prompt_tokens setting.
    Refuse a prompt over either (INVALID_ARGUMENT naming the limit), or keep its newest tokens
    when the request asked for truncation."""
    room = context_length - max_new_tokens
    if room < 1:
        raise InvalidArgument(
            f"sampling.max_new_tokens: must leave room for the prompt in the context of "
            f"{context_length} tokens, got {max_new_tokens}"
        )
    budget = min(room, max_prompt_tokens)
    if len(token_ids) <= budget:
        return token_ids
    if truncate_left:
        return token_ids[-budget:]
    if room <= max_prompt_tokens:
        raise InvalidArgument(
            f"prompt: {len(token_ids)} tokens + max_new_tokens {max_new_tokens} exceed the context length "
            f"{context_length} of {model}; shorten it or set truncation=TRUNCATION_LEFT"
        )
    raise InvalidArgument(
        f"prompt: {len(token_ids)} tokens, over the limit of max_prompt_tokens {max_prompt_tokens}; "
        "shorten it or set truncation=TRUNCATION_LEFT"
    )


MAX_TOP_LOGPROBS = 20
"""The most alternatives per token a request may ask for (OpenAI's limit)."""


@dataclass(frozen=True, slots=True)
class LogprobsRequest:
    """Log-probabilities asked for: each generated token's, and ``top`` alternatives per step."""

    top: int = 0


def checked_logprobs(enabled: bool, top_logprobs: int) -> LogprobsRequest | None:
    """A request's logprobs options, validated; None = not asked (nothing is computed)."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"logprobs.top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if top_logprobs and not enabled:
        raise InvalidArgument(f"logprobs.top_logprobs: requires logprobs.enabled, got top_logprobs {top_logprobs} "
                              "with enabled false")
    return LogprobsRequest(top=top_logprobs) if enabled else None


MAX_SCHEMA_CHARS = 65_536
"""The longest JSON Schema text a request may carry."""


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A constraint on the output's form: any JSON object (``schema`` empty) or JSON that
    validates against ``schema`` (its canonical JSON text)."""

    schema: str = ""

    def cache_key(self) -> str:
        """What of the format changes the answer (part of the cache scope)."""
        return json.dumps({"response_format": self.schema or "json_object"}, separators=(",", ":"))


def checked_response_format(kind: str | None, schema_text: str) -> ResponseFormat | None:
    """A request's response_format, validated at admission: a json_schema must be a JSON object
    that the grammar library (xgrammar, docs/decisions.md) compiles; otherwise INVALID_ARGUMENT,
    never a silently looser constraint. None = free text."""
    if kind is None:
        return None
    if kind == "json_object":
        return ResponseFormat()
    if not 1 <= len(schema_text) <= MAX_SCHEMA_CHARS:
        raise InvalidArgument(f"response_format.json_schema.schema: must be 1..{MAX_SCHEMA_CHARS} characters, "
                              f"got {len(schema_text)}")
    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        raise InvalidArgument(f"response_format.json_schema.schema: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise InvalidArgument("response_format.json_schema.schema: must be a JSON object")
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    import xgrammar  # noqa: PLC0415 - heavy native import, paid only by requests that carry a schema

    try:
        xgrammar.Grammar.from_json_schema(canonical)
    except RuntimeError as exc:
        reason = str(exc).rsplit(": ", 1)[-1] if ": " in str(exc) else str(exc)
        raise InvalidArgument(f"response_format.json_schema.schema: not supported by the grammar compiler: "
                              f"{reason}") from None
    return ResponseFormat(schema=canonical)


def checked_min_similarity(value: float | None) -> float | None:
    """A request's cache_min_similarity, validated: [0, 1] or unset."""
    if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
        raise InvalidArgument(f"cache_min_similarity: must be in [0, 1], got {value}")
    return value


def rfc3339_ms(field: str, text: str) -> int | None:
    """An RFC 3339 time as Unix milliseconds; "" = None; INVALID_ARGUMENT names the field."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise InvalidArgument(f"{field}: must be an RFC 3339 time with an offset, e.g. 2025-01-31T00:00:00Z, "
                              f"got {text!r}")
    return int(moment.timestamp() * 1000)


def usage_period(since: str, until: str) -> tuple[int | None, int | None]:
    """GetUsage's period as Unix ms (``since`` inclusive, ``until`` exclusive; "" = open)."""
    since_ms, until_ms = rfc3339_ms("since", since), rfc3339_ms("until", until)
    if since_ms is not None and until_ms is not None and until_ms < since_ms:
        raise InvalidArgument(f"until: must not be before since ({since}), got {until}")
    return since_ms, until_ms

