"""The tokenizer and the cache over their replicas: each call or stream goes to the next
SERVING replica (``pool.py``).

The ``PromptTokenizer``, ``Detokenizer`` and ``AnswerCache`` of
``services/gateway/interfaces.py``. A unary tokenizer call that finds its replica gone is asked
once more of another (it changes nothing, so asking twice is safe). The cache is an
optimisation: while no cache replica is SERVING, caching is skipped (no lookup, no store), the
change is logged once (``cache_degraded`` / ``cache_restored``) and ``availability`` is told.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from aiserve.common.errors import Unavailable
from aiserve.common.finish import FinishReason
from aiserve.common.logging import get_logger
from services.gateway.detokenize_mux_client import MuxStream
from services.gateway.domain import CachedAnswer, CacheKey, Chunk, RenderedPrompt
from services.gateway.interfaces import AnswerStore
from services.gateway.pool import ReplicaPool
from services.gateway.replica_clients import CacheClients, TokenizerClients
from services.gateway.tokenizer_client import TokenizerClient

log = get_logger("fleet")

T = TypeVar("T")


class FleetTokenizer:
    """Renders, tokenizes and counts on the next SERVING tokenizer replica."""

    def __init__(self, pool: ReplicaPool[TokenizerClients]) -> None:
        self.pool = pool

    async def _call(self, ask: Callable[[TokenizerClient], Awaitable[T]]) -> T:
        replica = await self.pool.pick_ready()
        try:
            return await ask(replica.clients.tokenizer)
        except Unavailable:
            if not self.pool.replicas.usable((replica.address,)):
                raise  # no other replica to ask: its own error says most
            return await ask(self.pool.pick((replica.address,)).clients.tokenizer)

    async def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> RenderedPrompt:
        """A chat rendered with the model's template and the generation prompt."""
        return await self._call(lambda t: t.apply_chat_template(messages))

    async def tokenize(self, text: str) -> tuple[int, ...]:
        """A raw prompt's ids, with the model's special tokens."""
        return await self._call(lambda t: t.tokenize(text))

    async def count_tokens(self, prompt: str | None, messages: Sequence[tuple[str, str]] | None,
                           model: str) -> int:
        """Tokens of a prompt or a chat, exactly as a generation would render it."""
        return await self._call(lambda t: t.count_tokens(prompt, messages, model))

    async def token_bytes(self, ids: Sequence[int]) -> tuple[bytes, ...]:
        """The bytes each id stands for alone."""
        return await self._call(lambda t: t.token_bytes(ids))


class FleetDetokenizer:
    """Each generation's stream on the next SERVING tokenizer replica's shared call."""

    def __init__(self, pool: ReplicaPool[TokenizerClients]) -> None:
        self.pool = pool

    def open(self, request_id: str, skip_special_tokens: bool) -> MuxStream:
        """A new generation's stream (UNAVAILABLE when no tokenizer replica is SERVING). It
        takes no turn of its own: the generation's tokenize call just took one, and taking
        another would send every tokenize call to the same replica."""
        return self.pool.pick(advance=False).clients.detokenizer.open(request_id, skip_special_tokens)

    async def close(self) -> None:
        """The replicas own their calls (``Backends.close`` closes them)."""


class _Dropped:
    """The store of an answer while no cache replica is SERVING: nothing is sent."""

    def add(self, chunk: Chunk) -> None:
        """Nothing is kept."""

    async def commit(self, finish_reason: FinishReason) -> str:
        return ""

    def abort(self) -> None:
        """Nothing to drop."""


class FleetCache:
    """Lookups, stores and feedback on the next SERVING cache replica; skipped while none is."""

    def __init__(self, pool: ReplicaPool[CacheClients], availability: Callable[[bool], None]) -> None:
        self.pool = pool
        self._availability = availability
        self._is_available: bool | None = None
        availability(False)

    def on_change(self) -> None:
        """A cache replica's health changed: log and report it when availability flips."""
        available = bool(self.pool.replicas.usable())
        if available == self._is_available:
            return
        if not available and self._is_available is None and self.pool.is_settling:
            return  # still connecting: not degraded yet
        if available:
            if self._is_available is False:
                log.info("cache_restored", replicas=len(self.pool.replicas))
        else:
            log.warning("cache_degraded", reason=self.pool.replicas.why_none())
        self._is_available = available
        self._availability(available)

    async def lookup(self, key: CacheKey, min_similarity: float | None) -> CachedAnswer | None:
        """The cached answer, or None (a miss, the cache failed, or no cache replica SERVING)."""
        if not self.pool.replicas.usable():
            return None
        return await self.pool.pick().clients.cache.lookup(key, min_similarity)

    def open_store(self, key: CacheKey, timeout_s: float) -> AnswerStore:
        """Stream an answer into the next SERVING cache replica (dropped while none is)."""
        if not self.pool.replicas.usable():
            return _Dropped()
        return self.pool.pick().clients.cache.open_store(key, timeout_s)

    async def report_feedback(self, entry_id: str, is_negative: bool, similarity: float) -> None:
        """Best effort, on the next SERVING cache replica (skipped while none is)."""
        if self.pool.replicas.usable():
            await self.pool.pick().clients.cache.report_feedback(entry_id, is_negative, similarity)
