"""The usage ledger: one row per generation request, whatever its outcome (docs/gateway.md).

SQLite in WAL mode with ``synchronous=FULL``: a committed row survives a killed process and a
power cut. ``Ledger`` is the gateway's writer: one writer thread owns the writing connection and
commits whatever rows are waiting in one transaction (group commit: one fsync for many rows
under load); ``record`` returns when the row is durable, so the gateway can send a request's
final message only after its row is committed. ``LedgerReader`` answers the queries (totals,
buckets, rows, find, spent) over read-only connections: the writer uses it for its own reads
(WAL readers never block the writer), and the ``aiserve usage`` report opens it alone, which
creates nothing, runs no DDL and starts no thread. No grpc, no pb.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import astuple, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiserve.common.logging import get_logger

log = get_logger("ledger")

SCHEMA_VERSION = 2


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One request as billed. Times in ms; ``ended_at_ms`` is Unix time (UTC)."""

    request_id: str
    tenant: str
    """"" when the caller could not be authenticated."""
    api: str
    """"Generate" or "Complete"."""
    model: str
    status: str
    """The gRPC status code name the call ended with ("OK", "CANCELLED", ...)."""
    finish_reason: str
    """"stop", "length", "cancelled", "error", or "" when it never generated."""
    prompt_tokens: int
    completion_tokens: int
    cache_hit: bool
    queue_ms: int
    ttft_ms: int
    total_ms: int
    compute_ms: int
    kv_peak_bytes: int
    cost_micros: int
    traceparent: str
    ended_at_ms: int
    cache_entry_id: str = ""
    """On a cache hit: the cache entry that answered."""
    cache_similarity: float = 0.0
    user: str = ""
    """The caller's own end-user id (OpenAI's ``user`` over HTTP); "" when it sent none."""

    @property
    def day(self) -> str:
        return utc_day(self.ended_at_ms)


COLUMNS = tuple(f.name for f in fields(UsageRow))

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL, tenant TEXT NOT NULL, api TEXT NOT NULL, model TEXT NOT NULL,
    status TEXT NOT NULL, finish_reason TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cache_hit INTEGER NOT NULL,
    queue_ms INTEGER NOT NULL, ttft_ms INTEGER NOT NULL, total_ms INTEGER NOT NULL,
    compute_ms INTEGER NOT NULL, kv_peak_bytes INTEGER NOT NULL, cost_micros INTEGER NOT NULL,
    traceparent TEXT NOT NULL, ended_at_ms INTEGER NOT NULL,
    cache_entry_id TEXT NOT NULL, cache_similarity REAL NOT NULL, day TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_by_tenant_time ON usage(tenant, ended_at_ms);
CREATE INDEX IF NOT EXISTS usage_by_tenant_request ON usage(tenant, request_id);
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL, tenant TEXT NOT NULL,
    kind TEXT NOT NULL,            -- "rating", "abandoned" or "repeat"
    rating INTEGER NOT NULL,       -- -1 or 1 for a rating, 0 for a passive signal
    comment TEXT NOT NULL,
    related_request_id TEXT NOT NULL,  -- "repeat": the request that asked again
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_by_tenant_request ON feedback(tenant, request_id);
"""
_MIGRATIONS: dict[int, str] = {
    2: "ALTER TABLE usage ADD COLUMN user TEXT NOT NULL DEFAULT '';",
}
"""The DDL that brings a ledger of version N - 1 to version N (``PRAGMA user_version``). A new
file gets the version 1 tables, then every step, so that old and new files end up the same."""
_INSERT_USAGE = f"INSERT INTO usage ({', '.join(COLUMNS)}, day) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0


@dataclass(frozen=True, slots=True)
class Bucket:
    day: str
    model: str
    totals: Totals
    tenant: str = ""


def utc_day(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%d")


def connect(path: Path) -> sqlite3.Connection:
    """A connection in WAL mode with full durability, waiting up to 10 s on a locked database."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


class LedgerMissingError(FileNotFoundError):
    """There is no ledger file where one was expected (the gateway creates it on its first start)."""


class LedgerReader:
    """Read-only queries over a ledger file, from any thread (each opens its own connection).

    Connections are opened with ``mode=ro``: a reader never creates the file, never changes its
    bytes and runs no DDL (SQLite may add the WAL's ``-shm``/``-wal`` side files, as any reader
    of a WAL database does).
    """

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise LedgerMissingError(f"no usage ledger at {path} (the gateway writes it)")
        self.path = path

    def query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Rows of one read-only statement."""
        db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()

    def totals(self, tenant: str, since_ms: int | None = None, until_ms: int | None = None) -> Totals:
        """One tenant's totals over ``[since_ms, until_ms)`` (either end open when None)."""
        where, params = _period(tenant, since_ms, until_ms)
        (row,) = self.query(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
            f"COALESCE(SUM(cost_micros), 0) FROM usage WHERE {where}", params)
        return Totals(*row)

    def buckets(self, tenant: str | None, since_ms: int | None = None, until_ms: int | None = None) -> list[Bucket]:
        """Totals by tenant, UTC day and model, ascending (one tenant's, or every tenant's)."""
        where, params = _period(tenant, since_ms, until_ms)
        rows = self.query(
            "SELECT tenant, day, model, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cost_micros) "
            f"FROM usage WHERE {where} GROUP BY tenant, day, model ORDER BY tenant, day, model", params)
        return [Bucket(day, model, Totals(*sums), name) for name, day, model, *sums in rows]

    def spent(self, tenant: str, since_ms: int) -> int:
        """Micros the tenant was billed since ``since_ms`` (what a budget counts)."""
        return self.totals(tenant, since_ms).cost_micros

    def find(self, tenant: str, request_id: str) -> UsageRow | None:
        """The tenant's latest row with this request id; another tenant's rows are invisible."""
        rows = self.query(
            f"SELECT {', '.join(COLUMNS)} FROM usage WHERE tenant = ? AND request_id = ? ORDER BY id DESC LIMIT 1",
            (tenant, request_id))
        return _row(rows[0]) if rows else None

    def rows(self, tenant: str | None = None, since_ms: int | None = None,
             until_ms: int | None = None) -> list[UsageRow]:
        """Every row of the period (one tenant's or all), oldest first (the CSV export)."""
        where, params = _period(tenant, since_ms, until_ms)
        return [_row(r) for r in self.query(f"SELECT {', '.join(COLUMNS)} FROM usage WHERE {where} ORDER BY id",
                                            params)]


_Write = tuple[str, tuple[Any, ...], "Future[None]"]


class Ledger(LedgerReader):
    """Durable usage rows and feedback rows, written by one thread with group commit; the
    queries are ``LedgerReader``'s."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = connect(path)
        _migrate(self._db)
        super().__init__(path)
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="ledger-writer", daemon=True)
        self._thread.start()

    def write(self, sql: str, params: tuple[Any, ...]) -> Future[None]:
        """Queue one statement; the future is done when it is committed (or failed)."""
        done: Future[None] = Future()
        self._queue.put((sql, params, done))
        return done

    def submit(self, row: UsageRow) -> Future[None]:
        """Queue ``row`` without waiting (error paths: nothing is sent after it)."""
        return self.write(_INSERT_USAGE, (*astuple(row), row.day))

    async def record(self, row: UsageRow) -> None:
        """Write ``row`` and return once it is committed. Cancelling the wait keeps the row."""
        await asyncio.shield(asyncio.wrap_future(self.submit(row)))

    async def flush(self) -> None:
        """Return once everything queued before this call is committed."""
        await asyncio.wrap_future(self.write("SELECT 1", ()))

    def close(self) -> None:
        """Commit what is queued, then stop the writer."""
        self._queue.put(None)
        self._thread.join()
        self._db.close()

    def _work(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            is_closing = False
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    is_closing = True
                    break
                batch.append(item)
            self._commit(batch)
            if is_closing:
                return

    def _commit(self, batch: Sequence[_Write]) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for sql, params, _ in batch:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            log.error("ledger_write_failed", error=str(exc), rows=len(batch))
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            for _, _, done in batch:
                if done.set_running_or_notify_cancel():
                    done.set_exception(exc)
            return
        for _, _, done in batch:
            if done.set_running_or_notify_cancel():  # False: nobody waits for it any more
                done.set_result(None)


def _migrate(db: sqlite3.Connection) -> None:
    """Create the tables (version 1) if missing, then apply each migration the file lacks, each
    in its own transaction with its version."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = 1; COMMIT;")
        version = 1
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"ledger schema version {version} is newer than this gateway's {SCHEMA_VERSION}")
    for step in range(version + 1, SCHEMA_VERSION + 1):
        db.executescript(f"BEGIN; {_MIGRATIONS[step]} PRAGMA user_version = {step}; COMMIT;")
        log.info("ledger_migrated", version=step)


def _row(values: tuple[Any, ...]) -> UsageRow:
    data = dict(zip(COLUMNS, values, strict=True))
    data["cache_hit"] = bool(data["cache_hit"])
    return UsageRow(**data)


def _period(tenant: str | None, since_ms: int | None, until_ms: int | None) -> tuple[str, tuple[Any, ...]]:
    clauses: list[str] = ["1"]
    params: list[Any] = []
    if tenant is not None:
        clauses.append("tenant = ?")
        params.append(tenant)
    if since_ms is not None:
        clauses.append("ended_at_ms >= ?")
        params.append(since_ms)
    if until_ms is not None:
        clauses.append("ended_at_ms < ?")
        params.append(until_ms)
    return " AND ".join(clauses), tuple(params)
