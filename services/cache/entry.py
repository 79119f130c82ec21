"""What both tiers of the cache speak: the scope of an answer and a stored entry."""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything an answer depends on besides the prompt; entries never cross scopes."""

    model: str
    """"name@version" of the model that answered."""
    tenant: str = ""
    params: str = ""
    """The decoding parameters that change the answer, canonical text."""
    context: str = ""
    """The conversation before the query (system prompt, earlier turns), canonical text."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A stored answer. ``deltas`` are (characters, tokens) per streamed delta."""

    id: int
    """Row id in the record, also the vector id in the index; never reused."""
    entry_id: str
    """Public id (uuid4 hex), what feedback and invalidation name."""
    query: str
    text: str
    token_ids: tuple[int, ...]
    deltas: tuple[tuple[int, int], ...]
    finish_reason: str
    created_at: float
    """Seconds since the epoch."""
    expires_at: float
    """Seconds since the epoch."""


def require_scope_and_prompt(scope: CacheScope, prompt: str) -> None:
    """Raise InvalidArgument unless ``scope`` names its model and ``prompt`` is not empty."""
    if not scope.model:
        raise InvalidArgument("scope.model: required, \"name@version\" of the model that answered")
    if not prompt:
        raise InvalidArgument("prompt: must be at least one character")
