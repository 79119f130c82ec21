"""The record of the cache: every entry of both tiers, on SQLite, and how entries leave.

SQLite is the record of everything: the answer and its streamed deltas, the query text and its
embedding (so the faiss index can always be rebuilt from here), expiry, last use and feedback.
One connection in WAL mode, guarded by a lock; asyncio callers reach it through a worker
thread. Every entry has its own expiry (``ttl_s`` from the time it was stored); past
``max_entries`` the least recently used entries go first. Row ids are never reused
(AUTOINCREMENT), and are the vector ids of the index. Every removal is reported, with the ids,
to ``on_remove`` so the index and the metrics follow. The row layout is in record_schema.py.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from aiserve.common.errors import InvalidArgument
from aiserve.common.finish import STORABLE
from aiserve.common.logging import get_logger
from services.cache.component_config import RecordConfig
from services.cache.entry import CacheEntry, CacheScope, require_scope_and_prompt
from services.cache.record_schema import (
    ENTRY_COLUMNS,
    INSERT,
    SCHEMA,
    SCHEMA_VERSION,
    digest,
    entry_bytes,
    entry_key,
    entry_of_row,
    pack_deltas,
    pack_token_ids,
)

log = get_logger("cache")

RemovalHook = Callable[[str, Sequence[int]], None]
"""Called with (reason, row ids) when entries leave: "lru", "ttl", "invalidate",
"model_version", "feedback", "embedder", "replace" (same key stored again) or "abandoned"
(stored by a Store stream the client cancelled)."""
NOT_EVICTIONS = frozenset({"replace", "abandoned"})
"""Removal reasons that are no eviction: the entry was replaced, or should never have been kept."""


def _no_hook(_reason: str, _ids: Sequence[int]) -> None:
    return None


class CacheRecord:
    """The entries of both tiers on SQLite: store, find by key, expire, evict, invalidate.

    ``clock`` gives wall-clock seconds (entries outlive the process, so not a monotonic clock);
    tests inject their own. ``embedder_id`` is part of every namespace; when it differs from the
    one the file was written with, every entry is purged (its vector means nothing to the new
    model). ``config.shared_across_tenants`` drops the tenant from the namespace (explicit opt-in).
    """

    def __init__(
        self,
        path: Path,
        config: RecordConfig,
        *,
        embedder_id: str = "",
        clock: Callable[[], float] = time.time,
        on_remove: RemovalHook = _no_hook,
    ) -> None:
        self.config, self.embedder_id = config, embedder_id
        self._clock, self._on_remove = clock, on_remove
        self._lock = threading.Lock()
        self._versions: dict[str, str] = {}  # model name -> the version seen last
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the worker threads of asyncio.to_thread; the lock serialises it.
        self._conn = sqlite3.connect(path, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self.was_reset = self._open_schema()
        self._num_entries = self._conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        self._adopt_embedder()
        self.purge_expired()

    def _open_schema(self) -> bool:
        """Create the schema; a file of another schema version is emptied (it is only a cache)."""
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        tables = self._conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        reset = version != SCHEMA_VERSION and tables > 0
        with self._conn:
            if reset:
                self._conn.execute("DROP TABLE IF EXISTS entries")
                self._conn.execute("DROP TABLE IF EXISTS meta")
            self._conn.executescript(SCHEMA)
            self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return reset

    def _adopt_embedder(self) -> None:
        """Purge every entry written with another embedding model, then record this one."""
        with self._lock, self._conn:
            known = self._conn.execute("SELECT value FROM meta WHERE name = 'embedder'").fetchone()
            if known is not None and known[0] != self.embedder_id:
                self._delete("embedder", "1 = 1", ())
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('embedder', ?)", (self.embedder_id,))

    @property
    def num_entries(self) -> int:
        """Entries stored now (expired ones count until they are purged)."""
        return self._num_entries

    def namespace(self, scope: CacheScope) -> bytes:
        """The namespace of ``scope``: entries are found only from the same namespace."""
        tenant = "" if self.config.shared_across_tenants else scope.tenant
        return digest(scope.model, self.embedder_id, scope.context, scope.params, tenant)

    def get(self, key: bytes) -> CacheEntry | None:
        """The live entry stored under ``key`` (its last use set to now), or None; an expired
        one is deleted."""
        now = self._clock()
        with self._lock, self._conn:
            row = self._conn.execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            entry = entry_of_row(row)
            if entry.expires_at <= now:
                self._delete("ttl", "id = ?", (entry.id,))
                return None
            self._touch_locked(entry.id, now)
        return entry

    def live(self, namespace: bytes, ids: Sequence[int]) -> dict[int, CacheEntry]:
        """The entries among ``ids`` that belong to ``namespace`` and have not expired."""
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {ENTRY_COLUMNS} FROM entries WHERE id IN ({marks}) AND namespace = ? AND expires_at > ?",
                (*ids, namespace, self._clock())).fetchall()
        return {row[0]: entry_of_row(row) for row in rows}

    def touch(self, id_: int) -> None:
        """Count a hit of entry ``id_`` and make it the most recently used."""
        with self._lock, self._conn:
            self._touch_locked(id_, self._clock())

    def store(
        self, scope: CacheScope, prompt: str, text: str, token_ids: Sequence[int], finish_reason: str, *,
        query: str = "", embedding: bytes | None = None, deltas: Sequence[tuple[int, int]] = (),
        ttl_s: float | None = None,
    ) -> CacheEntry:
        """Store an answer (replacing one with the same namespace and prompt); returns the entry.

        Raises InvalidArgument for an empty model or prompt, a finish reason other than
        "stop"/"length", a ttl_s outside (0, ttl_s], or an entry over ``max_entry_bytes``.
        """
        require_scope_and_prompt(scope, prompt)
        if finish_reason not in STORABLE:  # only normally finished generations are stored
            raise InvalidArgument(f"finish_reason: only stop/length answers are stored, got {finish_reason!r}")
        ttl = self._checked_ttl(ttl_s)
        ids_blob = pack_token_ids(token_ids)
        deltas = tuple(deltas) or ((len(text), len(token_ids)),)
        deltas_blob = pack_deltas(deltas)
        self._check_size(entry_bytes(prompt, query, text, len(token_ids), len(deltas)))
        namespace, now, entry_id = self.namespace(scope), self._clock(), uuid.uuid4().hex
        id_ = self._insert((entry_id, entry_key(namespace, prompt), namespace, scope.model, scope.tenant, prompt,
                            query, text, ids_blob, deltas_blob, finish_reason, embedding, now, now + ttl, now))
        return CacheEntry(id_, entry_id, query, text, tuple(token_ids), deltas, finish_reason, now, now + ttl)

    def _checked_ttl(self, ttl_s: float | None) -> float:
        """The entry's lifetime: ``ttl_s`` if given (it may only shorten the setting), else the setting."""
        ttl = self.config.ttl_s if not ttl_s else ttl_s
        if not 0 < ttl <= self.config.ttl_s:
            raise InvalidArgument(f"ttl_s: must be in (0, {self.config.ttl_s}] seconds, got {ttl_s}")
        return ttl

    def _check_size(self, size: int) -> None:
        if size > self.config.max_entry_bytes:
            raise InvalidArgument(f"entry: prompt + query + text + token_ids take {size} bytes,"
                                  f" over max_entry_bytes {self.config.max_entry_bytes}")

    def _insert(self, row: tuple[object, ...]) -> int:
        """Insert a row of ``INSERT`` (replacing the entry of its key), then purge what expired
        and evict past ``max_entries``; returns the new row id."""
        key, now = row[1], row[-1]
        with self._lock, self._conn:
            self._delete("replace", "key = ?", (key,))
            cursor = self._conn.execute(INSERT, row)
            self._num_entries += 1
            self._delete("ttl", "expires_at <= ?", (now,))
            self._evict_lru_locked()
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def purge_expired(self) -> int:
        """Delete every entry past its expiry; returns how many went."""
        with self._lock, self._conn:
            return self._delete("ttl", "expires_at <= ?", (self._clock(),))

    def invalidate(self, model: str) -> int:
        """Delete every entry answered by ``model`` ("name@version"); returns how many went."""
        with self._lock, self._conn:
            return self._delete("invalidate", "model = ?", (model,))

    def invalidate_namespace(self, scope: CacheScope) -> int:
        """Delete every entry of ``scope``'s namespace; returns how many went."""
        with self._lock, self._conn:
            return self._delete("invalidate", "namespace = ?", (self.namespace(scope),))

    def invalidate_tenant(self, tenant: str) -> int:
        """Delete every entry stored for ``tenant``; returns how many went."""
        with self._lock, self._conn:
            return self._delete("invalidate", "tenant = ?", (tenant,))

    def invalidate_entry(self, entry_id: str, reason: str = "invalidate") -> int:
        """Delete the entry ``entry_id`` (``reason`` "abandoned": it should never have been kept);
        returns how many went (0 or 1)."""
        with self._lock, self._conn:
            return self._delete(reason, "entry_id = ?", (entry_id,))

    def note_model(self, model: str) -> int:
        """The first time a version of a model name is seen, purge the entries of its other
        versions (already unreachable: the version is part of the namespace), unless
        ``purge_old_versions`` is off; returns how many went."""
        name, _, version = model.rpartition("@")
        with self._lock, self._conn:
            if not self.config.purge_old_versions or not name or self._versions.get(name) == version:
                return 0
            self._versions[name] = version
            removed = self._purge_other_versions_locked(model)
        if removed:
            log.info("cache_model_version_purged", model=model, removed=removed)
        return removed

    def purge_other_versions(self, model: str) -> int:
        """Delete the entries of every other version of ``model``'s name ("name@version")."""
        with self._lock, self._conn:
            return self._purge_other_versions_locked(model)

    def _purge_other_versions_locked(self, model: str) -> int:
        name = model.rpartition("@")[0] or model
        return self._delete("model_version", "substr(model, 1, ?) = ? AND model != ?",
                            (len(name) + 1, name + "@", model))

    def feedback(self, entry_id: str, negative: bool) -> tuple[bool, bool]:
        """Record feedback on an entry; returns (found, removed). A negative report that brings
        the entry to ``feedback_evict_after`` negative reports (0 = never) removes it."""
        evict_after = self.config.feedback_evict_after
        with self._lock, self._conn:
            row = self._conn.execute(
                "UPDATE entries SET negative_feedback = negative_feedback + ? WHERE entry_id = ?"
                " RETURNING negative_feedback", (int(negative), entry_id)).fetchone()
            if row is None:
                return False, False
            if negative and evict_after and row[0] >= evict_after:
                return True, self._delete("feedback", "entry_id = ?", (entry_id,)) > 0
        return True, False

    def vectors(self, batch: int = 4096) -> Iterator[list[tuple[int, bytes, bytes]]]:
        """(id, namespace, embedding) of every entry with an embedding, in batches, by id."""
        last = 0
        while True:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT id, namespace, embedding FROM entries WHERE embedding IS NOT NULL AND id > ?"
                    " ORDER BY id LIMIT ?", (last, batch)).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield rows

    def fingerprint(self) -> tuple[int, int, int]:
        """(count, sum, max) of the ids that have an embedding: what the index must hold.
        Ids are never reused, so any insert or delete since a snapshot changes it."""
        with self._lock:
            count, total, top = self._conn.execute(
                "SELECT COUNT(*), TOTAL(id), MAX(id) FROM entries WHERE embedding IS NOT NULL").fetchone()
        return int(count), int(total), int(top or 0)

    def close(self) -> None:
        """Close the SQLite file."""
        with self._lock:
            self._conn.close()

    def _touch_locked(self, id_: int, now: float) -> None:
        self._conn.execute("UPDATE entries SET last_used = ?, hits = hits + 1 WHERE id = ?", (now, id_))

    def _evict_lru_locked(self) -> None:
        excess = self._num_entries - self.config.max_entries
        if excess > 0:
            # Ties on last_used (same clock tick) go in insertion order.
            self._delete("lru", "id IN (SELECT id FROM entries ORDER BY last_used, id LIMIT ?)", (excess,))

    def _delete(self, reason: str, where: str, args: tuple[object, ...]) -> int:
        ids = [row[0] for row in self._conn.execute(f"DELETE FROM entries WHERE {where} RETURNING id", args)]
        if ids:
            self._num_entries -= len(ids)
            self._on_remove(reason, ids)
        return len(ids)
