"""The cache's record on SQLite, and its exact-match tier: answers keyed by (namespace, prompt).

SQLite is the record of everything: the answer and its streamed deltas, the query text and its
embedding (so the faiss index can always be rebuilt from here), expiry, last use and feedback.
One connection in WAL mode, guarded by a lock; asyncio callers reach it through a worker
thread. Every entry has its own expiry (``ttl_s`` from the time it was stored); past
``max_entries`` the least recently used entries go first. Row ids are never reused
(AUTOINCREMENT), and are the vector ids of the index. Every removal is reported, with the ids,
to ``on_remove`` so the index and the metrics follow.
"""

from __future__ import annotations

import hashlib
import sqlite3
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.errors import InvalidArgument
from aiserve.common.finish import STORABLE

SCHEMA_VERSION = 2
_TOKEN_ID_BYTES = 4  # token ids are stored as little-endian uint32
_DELTA_BYTES = 8  # a delta is stored as two little-endian uint32: characters, tokens

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- also the vector id in the faiss index
    entry_id TEXT NOT NULL UNIQUE,         -- public id (uuid4 hex)
    key BLOB NOT NULL UNIQUE,              -- sha256 of (namespace, prompt)
    namespace BLOB NOT NULL,               -- sha256 of (model, embedder, context, params, tenant)
    model TEXT NOT NULL,
    tenant TEXT NOT NULL,
    prompt TEXT NOT NULL,
    query TEXT NOT NULL,                   -- the embedded text; "" = exact tier only
    text TEXT NOT NULL,
    token_ids BLOB NOT NULL,               -- little-endian uint32 array
    deltas BLOB NOT NULL,                  -- little-endian uint32 pairs (characters, tokens)
    finish_reason TEXT NOT NULL,
    embedding BLOB,                        -- float32 [dim], unit length; NULL = exact tier only
    created_at REAL NOT NULL,              -- seconds since the epoch
    expires_at REAL NOT NULL,              -- seconds since the epoch
    last_used REAL NOT NULL,               -- seconds since the epoch
    hits INTEGER NOT NULL DEFAULT 0,
    negative_feedback INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS entries_by_last_used ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_by_expiry ON entries (expires_at);
CREATE INDEX IF NOT EXISTS entries_by_model ON entries (model);
CREATE INDEX IF NOT EXISTS entries_by_namespace ON entries (namespace);
CREATE INDEX IF NOT EXISTS entries_by_tenant ON entries (tenant);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_COLUMNS = "id, entry_id, query, text, token_ids, deltas, finish_reason, created_at, expires_at"


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything an answer depends on besides the prompt; entries never cross scopes."""

    model: str
    tenant: str = ""
    params: str = ""
    context: str = ""
    """The conversation before the query (system prompt, earlier turns), canonical text."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A stored answer. ``deltas`` are (characters, tokens) per streamed delta."""

    id: int
    entry_id: str
    query: str
    text: str
    token_ids: tuple[int, ...]
    deltas: tuple[tuple[int, int], ...]
    finish_reason: str
    created_at: float
    expires_at: float


RemovalHook = Callable[[str, Sequence[int]], None]
"""Called with (reason, row ids) when entries leave: "lru", "ttl", "invalidate",
"model_version", "feedback", "embedder" or "replace" (same key stored again)."""


def _no_hook(_reason: str, _ids: Sequence[int]) -> None:
    return None


def _digest(*parts: str | bytes) -> bytes:
    """sha256 over length-prefixed parts, so no two different tuples share a digest."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.digest()


def _validate(scope: CacheScope, prompt: str) -> None:
    if not scope.model:
        raise InvalidArgument("scope.model: required, \"name@version\" of the model that answered")
    if not prompt:
        raise InvalidArgument("prompt: must be at least one character")


def _pack(fmt: str, values: Sequence[int], field: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except struct.error as exc:
        raise InvalidArgument(f"{field}: each must be 0..4294967295") from exc


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // _TOKEN_ID_BYTES}I", blob)


def _unpack_deltas(blob: bytes) -> tuple[tuple[int, int], ...]:
    flat = struct.unpack(f"<{len(blob) // _TOKEN_ID_BYTES}I", blob)
    return tuple(zip(flat[::2], flat[1::2], strict=True))


def _entry(row: tuple) -> CacheEntry:  # type: ignore[type-arg]
    id_, entry_id, query, text, ids, deltas, finish, created_at, expires_at = row
    return CacheEntry(id_, entry_id, query, text, _unpack_ids(ids), _unpack_deltas(deltas), finish,
                      created_at, expires_at)


class ExactCache:
    """The record of the cache, and answers by exact (namespace, prompt) match.

    ``clock`` gives wall-clock seconds (entries outlive the process, so not a monotonic clock);
    tests inject their own. ``embedder_id`` is part of every namespace; when it differs from the
    one the file was written with, every entry is purged (its vector means nothing to the new
    model). ``shared_across_tenants`` drops the tenant from the namespace (explicit opt-in).
    """

    def __init__(
        self,
        path: Path,
        *,
        ttl_s: float,
        max_entries: int,
        max_entry_bytes: int,
        clock: Callable[[], float] = time.time,
        on_remove: RemovalHook = _no_hook,
        embedder_id: str = "",
        shared_across_tenants: bool = False,
    ) -> None:
        self.ttl_s, self.max_entries, self.max_entry_bytes = ttl_s, max_entries, max_entry_bytes
        self.embedder_id, self.shared_across_tenants = embedder_id, shared_across_tenants
        self._clock, self._on_remove = clock, on_remove
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the worker threads of asyncio.to_thread; the lock serialises it.
        self._conn = sqlite3.connect(path, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self.was_reset = self._open_schema()
        self._num_entries = self._conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        with self._lock, self._conn:
            known = self._conn.execute("SELECT value FROM meta WHERE name = 'embedder'").fetchone()
            if known is not None and known[0] != embedder_id:
                self._delete("embedder", "1 = 1", ())
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('embedder', ?)", (embedder_id,))
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
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return reset

    @property
    def num_entries(self) -> int:
        """Entries stored now (expired ones count until they are purged)."""
        return self._num_entries

    def namespace(self, scope: CacheScope) -> bytes:
        """The namespace of ``scope``: entries are found only from the same namespace."""
        tenant = "" if self.shared_across_tenants else scope.tenant
        return _digest(scope.model, self.embedder_id, scope.context, scope.params, tenant)

    def lookup(self, scope: CacheScope, prompt: str) -> CacheEntry | None:
        """The live entry for ``scope`` and ``prompt`` (its last use set to now), or None."""
        _validate(scope, prompt)
        key, now = _digest(self.namespace(scope), prompt), self._clock()
        with self._lock, self._conn:
            row = self._conn.execute(f"SELECT {_COLUMNS} FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            entry = _entry(row)
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
                f"SELECT {_COLUMNS} FROM entries WHERE id IN ({marks}) AND namespace = ? AND expires_at > ?",
                (*ids, namespace, self._clock())).fetchall()
        return {row[0]: _entry(row) for row in rows}

    def touch(self, id_: int) -> None:
        """Count a hit of entry ``id_`` and make it the most recently used."""
        with self._lock, self._conn:
            self._touch_locked(id_, self._clock())

    def store(
        self,
        scope: CacheScope,
        prompt: str,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str,
        *,
        query: str = "",
        embedding: bytes | None = None,
        deltas: Sequence[tuple[int, int]] = (),
        ttl_s: float | None = None,
    ) -> CacheEntry:
        """Store an answer (replacing one with the same namespace and prompt); returns the entry.

        Raises InvalidArgument for an empty model or prompt, a finish reason other than
        "stop"/"length", a ttl_s outside (0, ttl_s], or an entry over ``max_entry_bytes``.
        """
        _validate(scope, prompt)
        if finish_reason not in STORABLE:  # only normally finished generations are stored
            raise InvalidArgument(f"finish_reason: only stop/length answers are stored, got {finish_reason!r}")
        ttl = self.ttl_s if not ttl_s else ttl_s
        if not 0 < ttl <= self.ttl_s:
            raise InvalidArgument(f"ttl_s: must be in (0, {self.ttl_s}] seconds, got {ttl_s}")
        ids_blob = _pack("I", token_ids, "token_ids")
        deltas = tuple(deltas) or ((len(text), len(token_ids)),)
        deltas_blob = _pack("I", [n for pair in deltas for n in pair], "deltas")
        size = self.entry_bytes(prompt, query, text, len(token_ids), len(deltas))
        if size > self.max_entry_bytes:
            raise InvalidArgument(f"entry: prompt + query + text + token_ids take {size} bytes,"
                                  f" over max_entry_bytes {self.max_entry_bytes}")
        namespace, now = self.namespace(scope), self._clock()
        key, entry_id = _digest(namespace, prompt), uuid.uuid4().hex
        with self._lock, self._conn:
            self._delete("replace", "key = ?", (key,))
            cursor = self._conn.execute(
                "INSERT INTO entries (entry_id, key, namespace, model, tenant, prompt, query, text, token_ids,"
                " deltas, finish_reason, embedding, created_at, expires_at, last_used)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (entry_id, key, namespace, scope.model, scope.tenant, prompt, query, text, ids_blob,
                 deltas_blob, finish_reason, embedding, now, now + ttl, now))
            self._num_entries += 1
            self._delete("ttl", "expires_at <= ?", (now,))
            self._evict_lru_locked()
        assert cursor.lastrowid is not None
        return CacheEntry(cursor.lastrowid, entry_id, query, text, tuple(token_ids), deltas, finish_reason,
                          now, now + ttl)

    @staticmethod
    def entry_bytes(prompt: str, query: str, text: str, num_tokens: int, num_deltas: int) -> int:
        """Size an entry counts against ``max_entry_bytes``: UTF-8 text plus packed ids and deltas."""
        return (len(prompt.encode("utf-8")) + len(query.encode("utf-8")) + len(text.encode("utf-8"))
                + _TOKEN_ID_BYTES * num_tokens + _DELTA_BYTES * num_deltas)

    def purge_expired(self) -> int:
        """Delete every entry past its expiry; returns how many went."""
        with self._lock, self._conn:
            return self._delete("ttl", "expires_at <= ?", (self._clock(),))

    def invalidate(self, model: str) -> int:
        """Delete every entry answered by ``model`` ("name@version"); returns how many went."""
        with self._lock, self._conn:
            return self._delete("invalidate", "model = ?", (model,))

    def invalidate_namespace(self, scope: CacheScope) -> int:
        with self._lock, self._conn:
            return self._delete("invalidate", "namespace = ?", (self.namespace(scope),))

    def invalidate_tenant(self, tenant: str) -> int:
        with self._lock, self._conn:
            return self._delete("invalidate", "tenant = ?", (tenant,))

    def invalidate_entry(self, entry_id: str) -> int:
        with self._lock, self._conn:
            return self._delete("invalidate", "entry_id = ?", (entry_id,))

    def purge_other_versions(self, model: str) -> int:
        """Delete the entries of every other version of ``model``'s name ("name@version")."""
        name = model.rpartition("@")[0] or model
        with self._lock, self._conn:
            return self._delete("model_version", "substr(model, 1, ?) = ? AND model != ?",
                                (len(name) + 1, name + "@", model))

    def feedback(self, entry_id: str, negative: bool, evict_after: int) -> tuple[bool, bool]:
        """Record feedback on an entry; returns (found, removed). A negative report that brings
        the entry to ``evict_after`` negative reports (0 = never) removes it."""
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
        with self._lock:
            self._conn.close()

    def _touch_locked(self, id_: int, now: float) -> None:
        self._conn.execute("UPDATE entries SET last_used = ?, hits = hits + 1 WHERE id = ?", (now, id_))

    def _evict_lru_locked(self) -> None:
        excess = self._num_entries - self.max_entries
        if excess > 0:
            # Ties on last_used (same clock tick) go in insertion order.
            self._delete("lru", "id IN (SELECT id FROM entries ORDER BY last_used, id LIMIT ?)", (excess,))

    def _delete(self, reason: str, where: str, args: tuple[object, ...]) -> int:
        ids = [row[0] for row in self._conn.execute(f"DELETE FROM entries WHERE {where} RETURNING id", args)]
        if ids:
            self._num_entries -= len(ids)
            self._on_remove(reason, ids)
        return len(ids)
