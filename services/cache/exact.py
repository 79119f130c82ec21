"""The exact-match tier: answers keyed by (model, tenant, params, prompt), on SQLite.

One SQLite connection in WAL mode, guarded by a lock; asyncio callers reach it through
``asyncio.to_thread``. Entries carry their scope columns, so invalidation by model is one
DELETE. An entry lives ``ttl_s`` seconds from the time it was stored; past ``max_entries`` the
least recently used entries go first. Everything survives a restart.
"""

from __future__ import annotations

import hashlib
import sqlite3
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.errors import InvalidArgument

# Only normally finished generations are stored (DESIGN.md §2, step 6).
STORABLE_FINISH_REASONS = ("stop", "length")
# Similarity reported for a hit of this tier.
EXACT_SIMILARITY = 1.0
_TOKEN_ID_BYTES = 4  # token ids are stored as little-endian uint32

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key BLOB PRIMARY KEY,            -- sha256 of (model, tenant, params, prompt)
    entry_id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    tenant TEXT NOT NULL,
    params TEXT NOT NULL,
    prompt TEXT NOT NULL,
    text TEXT NOT NULL,
    token_ids BLOB NOT NULL,         -- little-endian uint32 array
    finish_reason TEXT NOT NULL,
    created_at REAL NOT NULL,        -- seconds since the epoch
    last_used REAL NOT NULL          -- seconds since the epoch
);
CREATE INDEX IF NOT EXISTS entries_by_last_used ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_by_created_at ON entries (created_at);
CREATE INDEX IF NOT EXISTS entries_by_model ON entries (model);
"""


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything an answer depends on besides the prompt; entries never cross scopes."""

    model: str
    tenant: str = ""
    params: str = ""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A stored answer."""

    entry_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    created_at: float
    last_used: float


EvictionHook = Callable[[str, int], None]
"""Called with (reason, number of entries) when entries leave: "lru", "ttl" or "invalidate"."""


def _no_hook(_reason: str, _count: int) -> None:
    return None


def entry_key(scope: CacheScope, prompt: str) -> bytes:
    """sha256 over the length-prefixed parts, so no two different tuples share a key."""
    digest = hashlib.sha256()
    for part in (scope.model, scope.tenant, scope.params, prompt):
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.digest()


def _validate(scope: CacheScope, prompt: str) -> None:
    if not scope.model:
        raise InvalidArgument("scope.model: required, \"name@version\" of the model that answered")
    if not prompt:
        raise InvalidArgument("prompt: must be at least one character")


def _pack_ids(token_ids: tuple[int, ...]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise InvalidArgument("token_ids: each must be 0..4294967295") from exc


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // _TOKEN_ID_BYTES}I", blob)


class ExactCache:
    """Answers by exact (scope, prompt) match, with TTL, LRU eviction and persistence.

    ``clock`` gives wall-clock seconds (entries outlive the process, so not a monotonic clock);
    tests inject their own. ``on_evict`` counts entries that leave without being replaced.
    """

    def __init__(
        self,
        path: Path,
        *,
        ttl_s: float,
        max_entries: int,
        max_entry_bytes: int,
        clock: Callable[[], float] = time.time,
        on_evict: EvictionHook = _no_hook,
    ) -> None:
        self.ttl_s, self.max_entries, self.max_entry_bytes = ttl_s, max_entries, max_entry_bytes
        self._clock, self._on_evict = clock, on_evict
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the worker threads of asyncio.to_thread; the lock serialises it.
        self._conn = sqlite3.connect(path, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._num_entries = self._conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        self.purge_expired()

    @property
    def num_entries(self) -> int:
        """Entries stored now (expired ones count until they are purged)."""
        return self._num_entries

    def lookup(self, scope: CacheScope, prompt: str) -> CacheEntry | None:
        """The live entry for ``scope`` and ``prompt`` (its last use set to now), or None."""
        _validate(scope, prompt)
        key, now = entry_key(scope, prompt), self._clock()
        with self._lock, self._conn:
            row = self._conn.execute(
                "SELECT entry_id, text, token_ids, finish_reason, created_at FROM entries"
                " WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            entry_id, text, blob, finish_reason, created_at = row
            if created_at + self.ttl_s <= now:
                self._conn.execute("DELETE FROM entries WHERE key = ?", (key,))
                self._removed("ttl", 1)
                return None
            self._conn.execute("UPDATE entries SET last_used = ? WHERE key = ?", (now, key))
        return CacheEntry(entry_id, text, _unpack_ids(blob), finish_reason, created_at, now)

    def store(
        self,
        scope: CacheScope,
        prompt: str,
        text: str,
        token_ids: tuple[int, ...],
        finish_reason: str,
    ) -> str:
        """Store an answer (replacing one with the same scope and prompt); returns its entry id.

        Raises InvalidArgument for an empty model or prompt, a finish reason other than
        "stop"/"length", or an entry over ``max_entry_bytes``.
        """
        _validate(scope, prompt)
        if finish_reason not in STORABLE_FINISH_REASONS:
            raise InvalidArgument(
                f"finish_reason: only {'/'.join(STORABLE_FINISH_REASONS)} answers are stored,"
                f" got {finish_reason!r}")
        blob = _pack_ids(token_ids)
        size = len(prompt.encode("utf-8")) + len(text.encode("utf-8")) + len(blob)
        if size > self.max_entry_bytes:
            raise InvalidArgument(
                f"entry: prompt + text + token_ids take {size} bytes,"
                f" over max_entry_bytes {self.max_entry_bytes}")
        key, now, entry_id = entry_key(scope, prompt), self._clock(), uuid.uuid4().hex
        with self._lock, self._conn:
            replaced = self._conn.execute("DELETE FROM entries WHERE key = ?", (key,)).rowcount
            self._conn.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, entry_id, scope.model, scope.tenant, scope.params, prompt, text, blob,
                 finish_reason, now, now))
            self._num_entries += 1 - replaced
            self._purge_expired_locked(now)
            self._evict_lru_locked()
        return entry_id

    def purge_expired(self) -> int:
        """Delete every entry older than ``ttl_s``; returns how many went."""
        with self._lock, self._conn:
            return self._purge_expired_locked(self._clock())

    def invalidate(self, model: str) -> int:
        """Delete every entry answered by ``model`` ("name@version"); returns how many went."""
        with self._lock, self._conn:
            count = self._conn.execute("DELETE FROM entries WHERE model = ?", (model,)).rowcount
            self._removed("invalidate", count)
        return count

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _purge_expired_locked(self, now: float) -> int:
        count = self._conn.execute(
            "DELETE FROM entries WHERE created_at <= ?", (now - self.ttl_s,)).rowcount
        self._removed("ttl", count)
        return count

    def _evict_lru_locked(self) -> None:
        excess = self._num_entries - self.max_entries
        if excess <= 0:
            return
        # Ties on last_used (same clock tick) go in insertion order.
        count = self._conn.execute(
            "DELETE FROM entries WHERE key IN"
            " (SELECT key FROM entries ORDER BY last_used, rowid LIMIT ?)", (excess,)).rowcount
        self._removed("lru", count)

    def _removed(self, reason: str, count: int) -> None:
        if count:
            self._num_entries -= count
            self._on_evict(reason, count)
