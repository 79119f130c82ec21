"""How the record lays an entry out in SQLite: the schema, the columns read back, the packing
of token ids and deltas, the keys, and the bytes an entry counts against ``max_entry_bytes``."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from aiserve.common.errors import InvalidArgument
from services.cache.entry import CacheEntry

SCHEMA_VERSION = 2
TOKEN_ID_BYTES = 4
"""A token id is stored as a little-endian uint32."""
DELTA_BYTES = 8
"""A delta is stored as two little-endian uint32: characters, tokens."""

SCHEMA = """
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
ENTRY_COLUMNS = "id, entry_id, query, text, token_ids, deltas, finish_reason, created_at, expires_at"
"""The columns ``entry_of_row`` reads, in its order."""
INSERT = ("INSERT INTO entries (entry_id, key, namespace, model, tenant, prompt, query, text, token_ids,"
          " deltas, finish_reason, embedding, created_at, expires_at, last_used)"
          " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def digest(*parts: str | bytes) -> bytes:
    """sha256 over length-prefixed parts, so no two different tuples share a digest."""
    hasher = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        hasher.update(len(data).to_bytes(8, "big"))
        hasher.update(data)
    return hasher.digest()


def entry_key(namespace: bytes, prompt: str) -> bytes:
    """The key of an entry: one answer per (namespace, prompt), found by the exact tier."""
    return digest(namespace, prompt)


def _pack(values: Sequence[int], field: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as exc:
        raise InvalidArgument(f"{field}: each must be 0..4294967295") from exc


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32; InvalidArgument names ``token_ids`` if one does not fit."""
    return _pack(token_ids, "token_ids")


def pack_deltas(deltas: Sequence[tuple[int, int]]) -> bytes:
    """(characters, tokens) pairs as little-endian uint32 pairs."""
    return _pack([n for pair in deltas for n in pair], "deltas")


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(blob) // TOKEN_ID_BYTES}I", blob)


def _unpack_deltas(blob: bytes) -> tuple[tuple[int, int], ...]:
    flat = _unpack_ids(blob)
    return tuple(zip(flat[::2], flat[1::2], strict=True))


def entry_of_row(row: tuple) -> CacheEntry:  # type: ignore[type-arg]
    """The entry of a row selected with ``ENTRY_COLUMNS``."""
    id_, entry_id, query, text, ids, deltas, finish, created_at, expires_at = row
    return CacheEntry(id_, entry_id, query, text, _unpack_ids(ids), _unpack_deltas(deltas), finish,
                      created_at, expires_at)


def entry_bytes(prompt: str, query: str, text: str, num_tokens: int, num_deltas: int) -> int:
    """Size an entry counts against ``max_entry_bytes``: UTF-8 text plus packed ids and deltas."""
    return (len(prompt.encode("utf-8")) + len(query.encode("utf-8")) + len(text.encode("utf-8"))
            + TOKEN_ID_BYTES * num_tokens + DELTA_BYTES * num_deltas)
