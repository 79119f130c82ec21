"""What the pipeline needs of its backends, as small interfaces over domain values.

The gRPC implementations are adapters at the edge (``backends.py`` builds them); tests give the
pipeline in-process fakes. Nothing here knows grpc or pb.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from aiserve.common.finish import FinishReason
from services.gateway.domain import (
    CachedAnswer,
    CacheKey,
    Chunk,
    GenerationEvent,
    GenerationRequest,
    RenderedPrompt,
    RequestOutcome,
    RouteInfo,
    VersionFigures,
)


class Router(Protocol):
    """The model versions and their checked routes: a tokenizer and an inference service that
    agree."""

    def pick(self, model: str, tenant: str = "", session: str = "") -> str:
        """The name@version that serves a request for ``model`` ("" = the default route, "name"
        = by its weights, sticky by ``tenant`` or ``session`` as configured, "name@version" =
        that one); NOT_FOUND when none does. The request holds it until ``release``."""
        ...

    async def route(self, model: str) -> RouteInfo:
        """The checked route of the version ``model`` (name@version) that ``pick`` gave;
        FAILED_PRECONDITION / UNAVAILABLE when it cannot serve."""
        ...

    def release(self, model: str) -> None:
        """The request that picked ``model`` finished (always called once after ``pick``)."""
        ...

    def forget_route(self) -> None:
        """Check the pairing again on the next request (a backend failed or restarted)."""
        ...


class PromptTokenizer(Protocol):
    """Turns a request's input into the model's token ids."""

    async def apply_chat_template(self, messages: Sequence[tuple[str, str]], model: str) -> RenderedPrompt:
        """A chat rendered with ``model``'s template and the generation prompt."""
        ...

    async def tokenize(self, text: str, model: str) -> tuple[int, ...]:
        """A raw prompt's ids (with ``model``'s special tokens)."""
        ...

    async def count_tokens(self, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                           model: str) -> int:
        """Tokens of a prompt or a chat, exactly as a generation would render it."""
        ...

    async def token_bytes(self, ids: Sequence[int], model: str) -> tuple[bytes, ...]:
        """The bytes each of ``model``'s ids stands for alone (for log-probabilities)."""
        ...


class Generation(Protocol):
    """One running generation, read event by event until one carries a finish reason."""

    async def read(self, timeout_s: float) -> GenerationEvent:
        """The next event; raises the generation's error, or DEADLINE_EXCEEDED when nothing
        comes within ``timeout_s``."""
        ...

    def close(self) -> None:
        """Always called: cancels the generation unless it ended."""
        ...


class Generations(Protocol):
    """Starts generations on the inference service."""

    def open(self, request: GenerationRequest, timeout_s: float) -> Generation:
        """Start ``request``; ``timeout_s`` is what is left of the client's deadline."""
        ...

    async def close(self) -> None:
        ...


class DetokenizerStream(Protocol):
    """One generation's incremental detokenization."""

    async def push(self, token_ids: tuple[int, ...], timeout_s: float) -> str:
        """The text ``token_ids`` complete (maybe "")."""
        ...

    async def finish(self, timeout_s: float) -> str:
        """The text still held back, once at the end."""
        ...

    def close(self) -> None:
        """Always called: forgets the stream unless it finished."""
        ...


class Detokenizer(Protocol):
    """Opens a detokenizer stream per generation."""

    def open(self, request_id: str, skip_special_tokens: bool, model: str) -> DetokenizerStream:
        """A stream on the tokenizer of ``model`` (the version the request was routed to)."""
        ...

    async def close(self) -> None:
        ...


class AnswerStore(Protocol):
    """A generation streamed into the cache as it is produced."""

    def add(self, chunk: Chunk) -> None:
        """One delta, exactly as the client received it (never waits on the cache)."""
        ...

    async def commit(self, finish_reason: FinishReason) -> str:
        """Keep the answer; returns its entry id ("" when the cache refused or failed)."""
        ...

    def abort(self) -> None:
        """Drop the answer (a no-op after ``commit``)."""
        ...


class AnswerCache(Protocol):
    """The semantic cache. An optimisation: its failures are misses and dropped stores."""

    async def lookup(self, key: CacheKey, min_similarity: float | None) -> CachedAnswer | None:
        """The cached answer, or None (a miss, or the cache failed)."""
        ...

    def open_store(self, key: CacheKey, timeout_s: float) -> AnswerStore:
        ...

    async def report_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        """How an answer the cache served was rated (best effort)."""
        ...


class RequestObserver(Protocol):
    """Sees every finished request (``observe``) and answers for each version what it saw
    (``figures``): the hook a judge of canaries plugs in (Admin's ``VersionFigures``)."""

    def observe(self, outcome: RequestOutcome) -> None:
        """One request ended (a Final, or a server-side or client error); never blocks."""
        ...

    def rated(self, model: str, negative: bool) -> None:
        """A client rated an answer of ``model`` (name@version)."""
        ...

    def figures(self, model: str) -> VersionFigures:
        """``model``'s (name@version) requests over the observer's window."""
        ...


class NoObserver:
    """The default ``RequestObserver``: keeps nothing, every version's figures are zeros."""

    def observe(self, outcome: RequestOutcome) -> None:
        """Nothing is kept."""

    def rated(self, model: str, negative: bool) -> None:
        """Nothing is kept."""

    def figures(self, model: str) -> VersionFigures:
        return VersionFigures()


@dataclass(frozen=True, slots=True)
class PipelineBackends:
    """Everything the pipeline calls; ``cache`` None = caching is off."""

    router: Router
    tokenizer: PromptTokenizer
    generations: Generations
    detokenizer: Detokenizer
    cache: AnswerCache | None
