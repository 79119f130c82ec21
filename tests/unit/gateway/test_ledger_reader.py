"""LedgerReader: the queries of the ledger over read-only connections, for ``aiserve usage``."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

import pytest

from services.gateway.ledger import Ledger, LedgerMissingError, LedgerReader, Totals
from tests.unit.gateway.test_ledger import DAY1, row


def fingerprint(path: Path) -> tuple[str, int]:
    """The file's bytes (as sha256) and its modification time (ns)."""
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    """A closed ledger with three rows of two tenants (its writer checkpointed on close)."""
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    try:
        for index, tenant in enumerate(("acme", "acme", "other")):
            ledger.submit(row(f"r{index}", tenant=tenant, ended_at_ms=DAY1 + index))
    finally:
        ledger.close()
    return path


def test_the_reader_answers_every_query(ledger_file: Path) -> None:
    reader = LedgerReader(ledger_file)
    assert reader.totals("acme") == Totals(2, 20, 10, 200)
    assert reader.spent("acme", DAY1 + 1) == 100
    assert [(b.tenant, b.day, b.totals.requests) for b in reader.buckets(None)] == [
        ("acme", "2025-01-15", 2), ("other", "2025-01-15", 1)]
    assert [r.request_id for r in reader.rows("acme")] == ["r0", "r1"]
    found = reader.find("acme", "r1")
    assert found is not None and found.tenant == "acme"
    assert reader.find("other", "r1") is None  # another tenant's row is invisible


def test_reading_a_report_never_changes_the_file(ledger_file: Path) -> None:
    threads_before = threading.active_count()
    before = fingerprint(ledger_file)
    reader = LedgerReader(ledger_file)
    reader.buckets(None)
    reader.rows(None)
    assert fingerprint(ledger_file) == before
    assert threading.active_count() == threads_before  # no writer thread
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.query("DELETE FROM usage", ())
    assert fingerprint(ledger_file) == before


def test_a_missing_ledger_is_a_clear_error_and_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "ledger.sqlite3"
    with pytest.raises(LedgerMissingError, match=f"no usage ledger at {path}"):
        LedgerReader(path)
    assert not path.parent.exists()


async def test_the_reader_sees_what_a_running_writer_committed(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    try:
        await ledger.record(row("r1"))
        assert [r.request_id for r in LedgerReader(ledger.path).rows()] == ["r1"]
        assert ledger.totals("acme") == Totals(1, 10, 5, 100)  # the writer's own reads
    finally:
        ledger.close()
