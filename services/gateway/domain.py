"""The gateway's domain values: what the pipeline takes, hands out, and exchanges with its
backends. Frozen slotted dataclasses; no grpc, no pb (the adapters at the edge convert).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.finish import FinishReason
from services.gateway.validation import LogprobsRequest, ResponseFormat, Sampling

ChatMessages = tuple[tuple[str, str], ...]
"""A chat as (role, content) pairs, oldest first."""


# --- the public API's side --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GatewayRequest:
    """A validated Generate/Complete request, as the pipeline needs it."""

    request_id: str
    prompt: str | None
    messages: ChatMessages | None
    sampling: Sampling
    model: str = ""
    cache_policy: str = "use"  # "use" | "bypass" | "refresh"
    personalized: bool = False
    truncate_left: bool = False
    tenant: str = ""
    priority: int = 0
    """Scheduling priority of the tenant's tier; higher is admitted to the batch first."""
    cache_min_similarity: float | None = None
    """A stricter similarity threshold for a cache hit by meaning (None = the cache's default)."""
    logprobs: LogprobsRequest | None = None
    """Log-probabilities asked for (None = none)."""
    response_format: ResponseFormat | None = None
    """A constraint on the output's form (None = free text)."""
    session: str = ""
    """The x-aiserve-session metadata value ("" = none): the sticky key when routes stick by session."""


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a generation needs to know of the call that carries it, whichever door it came in by."""

    authorization: str
    """The ``authorization`` metadata or header ("Bearer <API key>")."""
    session: str = ""
    """The x-aiserve-session value ("" = none)."""
    timeout_s: float | None = None
    """The client's remaining deadline (None = the default)."""
    user: str = ""
    """The caller's end-user id, recorded in the ledger row."""


@dataclass(frozen=True, slots=True)
class TokenAlternative:
    """A token the model could have picked at a step, with its log-probability."""

    token_id: int
    token_bytes: bytes
    """Its UTF-8 bytes (a piece of a character when a character spans tokens)."""
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely alternatives at its step."""

    token_id: int
    token_bytes: bytes
    logprob: float
    top: tuple[TokenAlternative, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """Text that became available, and the ids behind it."""

    text_delta: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per id of ``token_ids`` when the request asked for log-probabilities."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one generation used and cost (times in ms from the gateway receiving it)."""

    prompt_tokens: int
    completion_tokens: int
    cache_hit: bool
    queue_ms: int
    ttft_ms: int
    total_ms: int
    model: str
    cost_micros: int
    cache_similarity: float = 0.0
    compute_ms: int = 0
    kv_peak_bytes: int = 0
    cache_entry_id: str = ""
    """On a cache hit: the entry that answered (feedback on the answer is reported to it)."""


@dataclass(frozen=True, slots=True)
class Final:
    """The end of a generation: why it ended and what it used."""

    finish_reason: FinishReason
    usage: UsageRecord


@dataclass(frozen=True, slots=True)
class TokenCountRequest:
    """A validated CountTokens request: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None
    messages: ChatMessages | None
    model: str = ""


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Tokens of a rendered input, and the context they must fit in."""

    token_count: int
    context_length: int
    model: str


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """How one request ended, as a ``RequestObserver`` sees it (for its version's figures)."""

    model: str
    """name@version that answered (or was routed to, when it failed)."""
    ttft_ms: int
    tpot_ms: float
    """Time per output token after the first (0 with fewer than two tokens)."""
    is_error: bool
    """A server-side error (UNAVAILABLE, INTERNAL, a backend's deadline, a failed pairing);
    a client's own errors (invalid input, limits, cancelling) are not observed at all."""
    cache_hit: bool
    cost_micros: int


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """One version's requests over the last ``window_s`` seconds (zeros: nothing observed):
    what the Admin service reports and the canary judgement compares, plus how many requests
    each latency figure is made of (services/gateway/version_window.py)."""

    window_s: float = 0.0
    requests: int = 0
    error_rate: float = 0.0
    """Requests that ended with a server-side error, over ``requests``."""
    ttft_p50_ms: float = 0.0
    ttft_p95_ms: float = 0.0
    tpot_p50_ms: float = 0.0
    """Time per output token after the first."""
    tpot_p95_ms: float = 0.0
    cache_hit_rate: float = 0.0
    mean_cost_micros: float = 0.0
    negative_feedback_rate: float = 0.0
    """Negative ratings over the ratings received in the window."""
    ttft_samples: int = 0
    """Requests behind the TTFT percentiles: served by the model (no cache hit) with a first token."""
    tpot_samples: int = 0
    """Requests behind the TPOT percentiles: served by the model with a second token."""


# --- the backends' side -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RouteInfo:
    """What a checked route serves."""

    model: str
    """name@version, as both backends serve it."""
    context_length: int


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt as the model sees it: the text (chat template applied) and its token ids."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the inference service is asked to generate."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    priority: int
    logprobs: LogprobsRequest | None = None
    response_format: ResponseFormat | None = None


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One message of a running generation: its new ids and the running counters."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    """Set on the last event only."""
    queue_ms: int = 0
    compute_ms: int = 0
    kv_peak_bytes: int = 0
    logprobs: tuple[EngineLogprob, ...] = ()
    """One per id of ``token_ids`` when the request asked for log-probabilities."""


@dataclass(frozen=True, slots=True)
class EngineLogprob:
    """A token's log-probability as the engine reports it: ids only (the gateway adds the bytes)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(id, log-probability) of the most likely alternatives, most likely first."""


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything a cached answer depends on besides the prompt; answers never cross scopes."""

    model: str
    tenant: str
    params: str
    """Canonical text of the decoding parameters."""
    context: str
    """sha256 of the conversation before the last user message; "" for a raw prompt."""


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Where a request's answer is looked up and stored."""

    scope: CacheScope
    prompt: str
    """The rendered prompt: the exact tier's key."""
    query: str
    """What the semantic tier compares (the last user message); "" = exact tier only."""


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """A cache hit: the answer as it was streamed, and which entry gave it."""

    deltas: tuple[Chunk, ...]
    completion_tokens: int
    finish_reason: FinishReason
    similarity: float
    """Of the two queries, 0..1; 1.0 for an exact hit."""
    entry_id: str
