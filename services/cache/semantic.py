"""The cache: the exact tier first, then the semantic tier, over one record.

A lookup is a hit when the same namespace holds the same prompt (similarity 1.0), or else when
its nearest stored queries (by embedding) reach the threshold and agree on their key terms
(``guard.py``); the most similar such entry answers. Stores write the record (SQLite) and the
index together under one lock, so the two never disagree; every removal from the record
(TTL, LRU, invalidation, a new model version, negative feedback) removes the vector too.

No embedding happens here: callers pass vectors (the service computes them in a worker thread),
which keeps this class testable with synthetic vectors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiserve.common.errors import InvalidArgument
from aiserve.common.logging import get_logger
from services.cache.component_config import IndexParams, MatchRule, RecordConfig
from services.cache.embedder import Vector
from services.cache.entry import CacheEntry, CacheScope
from services.cache.exact import ExactTier
from services.cache.guard import disagreement, key_terms
from services.cache.index import VectorIndex
from services.cache.record import CacheRecord, RemovalHook

log = get_logger("cache")

EXACT_SIMILARITY = 1.0


@dataclass(frozen=True, slots=True)
class Hit:
    """A stored entry that answers a lookup, how similar its query is, and which tier found it."""

    entry: CacheEntry
    similarity: float
    tier: str  # "exact" | "semantic"


class SemanticCache:
    """Exact + semantic tiers over a CacheRecord and a VectorIndex. Thread-safe."""

    def __init__(
        self,
        record_path: Path,
        index_path: Path,
        *,
        dim: int,
        record: RecordConfig,
        rule: MatchRule,
        index: IndexParams,
        embedder_id: str = "",
        clock: Callable[[], float] = time.time,
        on_remove: RemovalHook | None = None,
    ) -> None:
        self.rule, self.index_path = rule, index_path
        self._on_remove = on_remove
        self._lock = threading.Lock()
        self._index = VectorIndex(dim, index)
        self.record = CacheRecord(record_path, record, embedder_id=embedder_id, clock=clock, on_remove=self._removed)
        self._exact = ExactTier(self.record)
        self.index_source = self._open_index()

    def _removed(self, reason: str, ids: Sequence[int]) -> None:
        self._index.remove(ids)
        if self._on_remove is not None:
            self._on_remove(reason, ids)

    def _open_index(self) -> str:
        """Load the snapshot, or rebuild from the record; returns "snapshot" or why it rebuilt."""
        started = time.perf_counter()
        why = self._index.load(self.index_path, self.record.fingerprint())
        if why is None:
            source = "snapshot"
        else:
            self._rebuild_index()
            source = f"rebuilt ({why})"
        log.info("cache_index_opened", source=source, vectors=len(self._index),
                 ms=round((time.perf_counter() - started) * 1000, 1))
        return source

    def _rebuild_index(self) -> None:
        """Fill the index from the embeddings stored in the record (no re-embedding), on every
        core the index may build with (nothing is served while the cache opens)."""
        self._index.clear()
        with self._index.building():
            for rows in self.record.vectors():
                by_space: dict[bytes, list[tuple[int, bytes]]] = {}
                for id_, namespace, blob in rows:
                    by_space.setdefault(namespace, []).append((id_, blob))
                for namespace, items in by_space.items():
                    ids = np.fromiter((i for i, _ in items), np.int64, len(items))
                    vectors = np.frombuffer(b"".join(b for _, b in items), np.float32).reshape(len(items), -1)
                    self._index.add(namespace, ids, vectors)

    @property
    def num_entries(self) -> int:
        """Entries in the record."""
        return self.record.num_entries

    @property
    def num_vectors(self) -> int:
        """Vectors in the index (entries stored with a query and its embedding)."""
        return len(self._index)

    def lookup(
        self, scope: CacheScope, prompt: str, query: str = "", vector: Vector | None = None,
        min_similarity: float | None = None,
    ) -> Hit | None:
        """The answer for ``prompt`` (exact tier) or for a query like ``query`` (semantic tier;
        needs its ``vector``), or None. ``min_similarity`` can only raise the threshold."""
        if min_similarity is not None and not 0.0 <= min_similarity <= 1.0:
            raise InvalidArgument(f"min_similarity: must be in [0, 1], got {min_similarity}")
        threshold = max(self.rule.similarity_threshold, min_similarity or 0.0)
        with self._lock:
            self.record.note_model(scope.model)
            if (entry := self._exact.lookup(scope, prompt)) is not None:
                return Hit(entry, EXACT_SIMILARITY, "exact")
            if vector is None or not query:
                return None
            return self._semantic_hit(self.record.namespace(scope), query, vector, threshold)

    def _semantic_hit(self, namespace: bytes, query: str, vector: Vector, threshold: float) -> Hit | None:
        """The most similar live entry of ``namespace`` at or over ``threshold`` whose key terms
        agree with ``query`` (when the guard is on), or None. The caller holds the lock."""
        found = [(i, s) for i, s in self._index.search(namespace, vector, self.rule.candidates) if s >= threshold]
        if not found:
            return None
        live = self.record.live(namespace, [i for i, _ in found])
        terms = key_terms(query) if self.rule.key_term_guard else None
        for id_, similarity in found:
            entry = live.get(id_)
            if entry is None:
                continue
            if terms is not None and disagreement(terms, key_terms(entry.query)) is not None:
                continue
            self.record.touch(id_)
            return Hit(entry, min(similarity, EXACT_SIMILARITY), "semantic")
        return None

    def store(
        self, scope: CacheScope, prompt: str, text: str, token_ids: Sequence[int], finish_reason: str, *,
        query: str = "", vector: Vector | None = None, deltas: Sequence[tuple[int, int]] = (),
        ttl_s: float | None = None,
    ) -> CacheEntry:
        """Store an answer in the record, and its query's vector in the index (when given)."""
        embedding = None if vector is None or not query else np.asarray(vector, np.float32).tobytes()
        with self._lock:
            self.record.note_model(scope.model)
            entry = self.record.store(scope, prompt, text, token_ids, finish_reason, query=query,
                                      embedding=embedding, deltas=deltas, ttl_s=ttl_s)
            if embedding is not None:
                self._index.add(self.record.namespace(scope), np.array([entry.id], np.int64),
                                np.frombuffer(embedding, np.float32).reshape(1, -1))
        return entry

    def invalidate(self, *, model: str = "", scope: CacheScope | None = None, tenant: str = "",
                   entry_id: str = "") -> int:
        """Remove the entries of one model, namespace, tenant or entry; returns how many went."""
        with self._lock:
            if model:
                return self.record.invalidate(model)
            if scope is not None:
                return self.record.invalidate_namespace(scope)
            if tenant:
                return self.record.invalidate_tenant(tenant)
            if entry_id:
                return self.record.invalidate_entry(entry_id)
        raise InvalidArgument("target: set one of model, scope, tenant or entry_id")

    def discard(self, entry_id: str) -> int:
        """Remove an entry that should never have been kept (its Store was cancelled while it
        was being committed): not counted as an eviction. Returns how many went (0 or 1)."""
        with self._lock:
            return self.record.invalidate_entry(entry_id, reason="abandoned")

    def feedback(self, entry_id: str, negative: bool) -> tuple[bool, bool]:
        """(found, removed): see CacheRecord.feedback."""
        with self._lock:
            return self.record.feedback(entry_id, negative)

    def snapshot(self) -> None:
        """Write the index snapshot (on shutdown; a crash costs only a rebuild at the next start)."""
        with self._lock:
            self._index.save(self.index_path)

    def close(self) -> None:
        """Write the index snapshot and close the record."""
        with self._lock:
            self._index.save(self.index_path)
            self.record.close()
