"""The ledger on real SQLite: durable rows, group commit, per-tenant reads."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path

from services.gateway.ledger import Ledger, Totals, UsageRow

DAY1 = 1736942400000  # 2025-01-15T12:00:00Z


def row(request_id: str, tenant: str = "acme", **changes: object) -> UsageRow:
    base = UsageRow(
        request_id=request_id,
        tenant=tenant,
        api="Generate",
        model="m@1",
        status="OK",
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=5,
        cache_hit=False,
        queue_ms=1,
        ttft_ms=2,
        total_ms=3,
        compute_ms=4,
        kv_peak_bytes=1024,
        cost_micros=100,
        traceparent="",
        ended_at_ms=DAY1,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


async def test_many_concurrent_rows_are_all_committed(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    try:
        await asyncio.gather(*(ledger.record(row(f"r{i}", tenant=f"t{i % 3}")) for i in range(300)))
        # Committed means visible to a fresh connection (another process would see it too).
        with sqlite3.connect(tmp_path / "ledger.sqlite3") as db:
            assert db.execute("SELECT COUNT(*) FROM usage").fetchone() == (300,)
        assert ledger.totals("t0") == Totals(100, 1000, 500, 10_000)
    finally:
        ledger.close()


def test_close_commits_what_is_queued(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    futures = [ledger.submit(row(f"r{i}")) for i in range(50)]
    ledger.close()
    assert all(f.done() and f.exception() is None for f in futures)
    reopened = Ledger(tmp_path / "ledger.sqlite3")
    try:
        assert reopened.totals("acme").requests == 50
    finally:
        reopened.close()


async def test_reads_see_only_the_tenants_own_rows(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    try:
        await ledger.record(row("a1"))
        await ledger.record(row("a2", model="m@2", ended_at_ms=DAY1 + 86_400_000, cost_micros=7))
        await ledger.record(row("shared-id", tenant="other", cost_micros=999))
        assert ledger.find("acme", "shared-id") is None
        assert ledger.find("other", "shared-id") is not None
        assert ledger.totals("acme") == Totals(2, 20, 10, 107)
        assert ledger.totals("acme", since_ms=DAY1 + 1) == Totals(1, 10, 5, 7)
        assert ledger.totals("acme", until_ms=DAY1 + 1) == Totals(1, 10, 5, 100)
        assert [(b.day, b.model, b.totals.requests) for b in ledger.buckets("acme")] == [
            ("2025-01-15", "m@1", 1),
            ("2025-01-16", "m@2", 1),
        ]
        assert ledger.spent("acme", DAY1 + 1) == 7
        found = ledger.find("acme", "a1")
        assert found == row("a1")
    finally:
        ledger.close()


V1_USAGE = """
CREATE TABLE usage (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL, tenant TEXT NOT NULL, api TEXT NOT NULL, model TEXT NOT NULL,
    status TEXT NOT NULL, finish_reason TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, cache_hit INTEGER NOT NULL,
    queue_ms INTEGER NOT NULL, ttft_ms INTEGER NOT NULL, total_ms INTEGER NOT NULL,
    compute_ms INTEGER NOT NULL, kv_peak_bytes INTEGER NOT NULL, cost_micros INTEGER NOT NULL,
    traceparent TEXT NOT NULL, ended_at_ms INTEGER NOT NULL,
    cache_entry_id TEXT NOT NULL, cache_similarity REAL NOT NULL, day TEXT NOT NULL
);
INSERT INTO usage VALUES (1, 'old', 'acme', 'Generate', 'm@1', 'OK', 'stop', 1, 2, 0, 0, 0, 0, 0, 0, 30, '',
                          1736942400000, '', 0.0, '2025-01-15');
PRAGMA user_version = 1;
"""


async def test_a_version_1_ledger_gains_the_user_column_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(V1_USAGE)
    db.close()
    ledger = Ledger(path)
    try:
        await ledger.record(row("new", user="end-user-1"))
        (old,) = [r for r in ledger.rows("acme") if r.request_id == "old"]
        assert old.user == "" and old.cost_micros == 30
        assert ledger.find("acme", "new").user == "end-user-1"  # type: ignore[union-attr]
        assert ledger.query("PRAGMA user_version", ()) == [(2,)]
    finally:
        ledger.close()
    again = Ledger(path)  # opening a current file changes nothing
    try:
        assert len(again.rows("acme")) == 2 and again.query("PRAGMA user_version", ()) == [(2,)]
    finally:
        again.close()
