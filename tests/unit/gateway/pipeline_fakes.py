"""In-process fakes of the pipeline's backend interfaces (``services/gateway/interfaces.py``):
each records what the pipeline asked of it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiserve.common.finish import FinishReason
from services.gateway.config import GatewayConfig
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
from services.gateway.interfaces import PipelineBackends
from services.gateway.pipeline import Pipeline

MODEL = "m@1"
CONFIG = GatewayConfig(default_model=MODEL, prices=(f"{MODEL}=10/20/1000",), max_prompt_tokens=100)


@dataclass
class FakeRouter:
    context_length: int = 64
    forgotten: int = 0
    routed: list[tuple[str, str, str]] = field(default_factory=list)
    """(model, tenant, session) of each pick."""
    released: list[str] = field(default_factory=list)
    version: str = ""
    """The name@version every request is routed to ("" = the model asked for, or MODEL)."""
    refusal: Exception | None = None
    """Raised by ``route`` (the version's pairing check failed)."""

    def pick(self, model: str, tenant: str = "", session: str = "") -> str:
        self.routed.append((model, tenant, session))
        return self.version or model or MODEL

    async def route(self, model: str) -> RouteInfo:
        if self.refusal is not None:
            raise self.refusal
        return RouteInfo(model, self.context_length)

    def release(self, model: str) -> None:
        self.released.append(model)

    def forget_route(self) -> None:
        self.forgotten += 1


@dataclass
class FakeTokenizer:
    """One token per word (id = the word's length); a chat renders as "role: content" lines."""

    models: list[str] = field(default_factory=list)
    """The version each render or tokenize call was for."""

    async def apply_chat_template(self, messages: Sequence[tuple[str, str]], model: str) -> RenderedPrompt:
        self.models.append(model)
        text = "".join(f"{role}: {content}\n" for role, content in messages)
        return RenderedPrompt(text, tuple(len(w) for w in text.split()))

    async def tokenize(self, text: str, model: str) -> tuple[int, ...]:
        self.models.append(model)
        return tuple(len(w) for w in text.split())

    async def count_tokens(self, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                           model: str) -> int:
        return len((prompt or "").split()) + 1000 * (model == MODEL)

    async def token_bytes(self, ids: Sequence[int], model: str) -> tuple[bytes, ...]:
        self.models.append(model)
        return tuple(f"<{i}>".encode() for i in ids)


class FakeGeneration:
    """Reads its script; an exception in it is raised in its turn. With ``held``, its first read
    waits for that event (a prefill that takes a while); ``reading`` is set when it starts."""

    def __init__(self, script: list[GenerationEvent | Exception], held: asyncio.Event | None = None,
                 failed: asyncio.Event | None = None, reading: asyncio.Event | None = None) -> None:
        self.script = list(script)
        self.held, self.failed = held, failed
        self.reading = reading or asyncio.Event()
        self.is_ended = self.is_closed = False

    async def read(self, timeout_s: float) -> GenerationEvent:
        if not self.reading.is_set():
            self.reading.set()
            if self.held is not None:
                await self.held.wait()
        item = self.script.pop(0)
        self.is_ended = isinstance(item, Exception) or item.finish_reason is not None
        if isinstance(item, Exception):
            if self.failed is not None:
                self.failed.set()
            raise item
        return item

    def close(self) -> None:
        self.is_closed = True

    @property
    def is_cancelled(self) -> bool:
        return self.is_closed and not self.is_ended


@dataclass
class FakeGenerations:
    script: list[GenerationEvent | Exception] = field(default_factory=list)
    opened: list[tuple[GenerationRequest, float, FakeGeneration]] = field(default_factory=list)
    held: asyncio.Event | None = None
    """Every generation's first read waits for it."""
    failed: asyncio.Event | None = None
    """Set when a generation raises an error of its script."""
    reading: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the first generation begins to read."""

    def open(self, request: GenerationRequest, timeout_s: float) -> FakeGeneration:
        generation = FakeGeneration(self.script, self.held, self.failed, self.reading if not self.opened else None)
        self.opened.append((request, timeout_s, generation))
        return generation

    async def close(self) -> None:
        pass


@dataclass
class FakeDetokenizerStream:
    texts: dict[int, str]
    held: str
    is_closed: bool = False

    async def push(self, token_ids: tuple[int, ...], timeout_s: float) -> str:
        return "".join(self.texts.get(t, f"w{t} ") for t in token_ids)

    async def finish(self, timeout_s: float) -> str:
        return self.held

    def close(self) -> None:
        self.is_closed = True


@dataclass
class FakeDetokenizer:
    texts: dict[int, str] = field(default_factory=dict)
    held: str = ""
    streams: list[FakeDetokenizerStream] = field(default_factory=list)
    models: list[str] = field(default_factory=list)

    def open(self, request_id: str, skip_special_tokens: bool, model: str) -> FakeDetokenizerStream:
        self.models.append(model)
        stream = FakeDetokenizerStream(self.texts, self.held)
        self.streams.append(stream)
        return stream

    async def close(self) -> None:
        pass


@dataclass
class FakeStore:
    key: CacheKey
    added: list[Chunk] = field(default_factory=list)
    committed: FinishReason | None = None
    is_aborted: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once committed or aborted."""

    def add(self, chunk: Chunk) -> None:
        self.added.append(chunk)

    async def commit(self, finish_reason: FinishReason) -> str:
        self.committed = finish_reason
        self.ended.set()
        return "entry-1"

    def abort(self) -> None:
        if self.committed is None:
            self.is_aborted = True
            self.ended.set()


@dataclass
class FakeCache:
    """The exact tier (a lookup without a query) finds ``answer``; a lookup with a query finds
    ``answer`` or else ``by_meaning``, after ``held`` is set (a slow embedding), or raises ``error``."""

    answer: CachedAnswer | None = None
    by_meaning: CachedAnswer | None = None
    held: asyncio.Event | None = None
    exact_held: asyncio.Event | None = None
    """The exact tier's lookups wait for it."""
    error: Exception | None = None
    lookups: list[tuple[CacheKey, float | None]] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a lookup is cancelled while it waits."""
    stores: list[FakeStore] = field(default_factory=list)
    feedback: list[tuple[str, bool, float]] = field(default_factory=list)

    async def lookup(self, key: CacheKey, min_similarity: float | None) -> CachedAnswer | None:
        self.lookups.append((key, min_similarity))
        held = self.held if key.query else self.exact_held
        try:
            if held is not None:
                await held.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if not key.query:
            return self.answer
        if self.error is not None:
            raise self.error
        return self.answer or self.by_meaning

    def open_store(self, key: CacheKey, timeout_s: float) -> FakeStore:
        self.stores.append(FakeStore(key))
        return self.stores[-1]

    async def report_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        self.feedback.append((entry_id, is_negative, similarity))


@dataclass
class Fakes:
    router: FakeRouter = field(default_factory=FakeRouter)
    generations: FakeGenerations = field(default_factory=FakeGenerations)
    detokenizer: FakeDetokenizer = field(default_factory=FakeDetokenizer)
    cache: FakeCache = field(default_factory=FakeCache)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    observer: FakeObserver = field(default_factory=lambda: FakeObserver())
    lookup_outcomes: list[str] = field(default_factory=list)
    """How each cache lookup ended, as the pipeline reported it."""

    def pipeline(self, config: GatewayConfig = CONFIG) -> Pipeline:
        backends = PipelineBackends(self.router, self.tokenizer, self.generations, self.detokenizer, self.cache)
        return Pipeline(config, backends, config.price_table(), self.observer, self.lookup_outcomes.append)


@dataclass
class FakeObserver:
    """Records every outcome; its figures count them."""

    outcomes: list[RequestOutcome] = field(default_factory=list)

    def observe(self, outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)

    def rated(self, model: str, negative: bool) -> None:
        """Ratings are not what these tests look at."""

    def figures(self, model: str) -> VersionFigures:
        return VersionFigures(requests=sum(o.model == model for o in self.outcomes))
