"""``aiserve usage`` reads the ledger and changes nothing; ``aiserve keys`` manages keys."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from aiserve.common.paths import LEDGER_FILE
from services.gateway.ledger import Ledger
from suite.cli import main
from tests.unit.gateway.test_ledger import DAY1, row
from tests.unit.gateway.test_ledger_reader import fingerprint

ROOT = Path(__file__).resolve().parents[3]


def aiserve(*argv: str) -> int:
    """Run one ``aiserve`` command in this process; its exit code."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    return int(info.value.code or 0)


def test_usage_reports_and_exports_without_changing_the_ledger(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / LEDGER_FILE
    ledger = Ledger(path)
    try:
        ledger.submit(row("r1", tenant="acme"))
        ledger.submit(row("r2", tenant="acme", ended_at_ms=DAY1 + 1))
    finally:
        ledger.close()
    before = fingerprint(path)
    out = tmp_path / "usage.csv"
    assert aiserve("usage", "--home", str(tmp_path), "--tenant", "acme", "--csv", str(out)) == 0
    report = capsys.readouterr().out
    assert "acme" in report and "total: 2 requests, cost 0.000200 (200 micros)" in report
    with out.open(newline="") as file:
        assert [r["request_id"] for r in csv.DictReader(file)] == ["r1", "r2"]
    assert fingerprint(path) == before


def test_usage_without_a_ledger_is_a_clear_error_and_creates_nothing(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert aiserve("usage", "--home", str(tmp_path)) == 2
    assert f"no usage ledger at {tmp_path / LEDGER_FILE}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_keys_create_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert aiserve("keys", "create", "--tenant", "acme", "--tier", "paid", "--home", str(tmp_path)) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("ais_")
    assert aiserve("keys", "list", "--home", str(tmp_path)) == 0
    assert f"ais_{key.split('_')[1]}\tacme\tpaid" in capsys.readouterr().out


def test_python_m_suite_is_the_aiserve_command() -> None:
    result = subprocess.run([sys.executable, "-m", "suite", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: aiserve")
    for command in ("models", "run", "chat", "keys", "usage"):
        assert command in result.stdout
