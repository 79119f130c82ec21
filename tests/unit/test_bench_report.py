"""bench/report.py on sample JSON: present sections render their figures, absent ones say so."""

import json
from pathlib import Path

from bench import report

HOST = {"cpu": "Test CPU", "flags": "avx2", "cores": "2", "torch": "2.x", "python": "3.x"}


def test_present_and_absent_sections(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps({"a": {"gateway": {"tokens_per_s": 12.5}}, "runs": [1, 2]}))
    (tmp_path / "engine.png").write_bytes(b"png")
    (tmp_path / "fleet.json").write_text("{not json")
    text = report.render(tmp_path, HOST)
    assert "- cpu: Test CPU" in text and "- torch: 2.x" in text
    assert "| a.gateway.tokens_per_s | 12.5 |" in text
    assert "| runs | 2 entries |" in text
    assert "![Engine](engine.png)" in text
    assert "not measured in this run (no bench/results/kv_cache.json)." in text
    assert "not measured in this run (bench/results/fleet.json unreadable" in text
    assert text.count(report.NOT_MEASURED) == len(report.SECTIONS) - 1


def test_write_creates_report(tmp_path: Path) -> None:
    out = report.write(tmp_path)
    assert out == tmp_path / "report.md"
    assert out.read_text().startswith("# aiserve benchmark report")


def test_machine_names_cpu_cores_torch() -> None:
    host = report.machine()
    assert host["cpu"] and int(host["cores"]) >= 1 and host["torch"]
