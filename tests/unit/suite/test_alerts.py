"""aiserve alerts thresholds: the arithmetic on hand-worked history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from suite.alerts import current_thresholds, from_bench, from_prometheus_result, propose
from suite.cli import main

RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "rules.yaml"


def test_warning_is_the_factor_times_the_observed_p99_and_critical_twice_that() -> None:
    p = propose("ttft", 1.2)
    assert (p.warning_s, p.critical_s) == (1.8, 3.6)
    assert propose("ttft", 0.4, factor=2.0).warning_s == 0.8
    with pytest.raises(ValueError):
        propose("ttft", 0.0)
    with pytest.raises(ValueError):
        propose("ttft", 1.0, factor=1.0)


def test_the_worst_p99_of_a_bench_json_anywhere_in_it() -> None:
    bench = {"runs": [{"aiserve": {"ttft": {"p50_ms": 300, "p99_ms": 900}, "time_per_token": {"p99_ms": 70}}},
                      {"aiserve": {"ttft": {"p99_ms": 1300}, "inter_token": {"p99_ms": 120}}}],
             "other": {"p99_ms": 99_999}}  # not under a figure's key: ignored
    assert from_bench(bench) == {"ttft": 1.3, "tpot": 0.12}
    assert from_bench({"nothing": 1}) == {}


def test_the_highest_finite_point_of_a_prometheus_range() -> None:
    answer = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {}, "values": [[1, "0.8"], [2, "NaN"], [3, "1.6"]]},
        {"metric": {}, "values": [[1, "1.1"], [2, "+Inf"]]}]}}
    assert from_prometheus_result(answer) == 1.6
    assert from_prometheus_result({"status": "success", "data": {"result": []}}) is None
    with pytest.raises(ValueError, match="bad_data"):
        from_prometheus_result({"status": "error", "error": "bad_data"})


def test_the_current_ttft_thresholds_are_read_from_the_rules() -> None:
    assert current_thresholds(RULES) == {"ttft": {"warning": 2.0, "critical": 4.0}}


def test_the_command_prints_proposals_from_a_bench_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"aiserve": {"ttft": {"p99_ms": 1000}}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["alerts", "thresholds", "--bench", str(bench)])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "1.500s" in out and "3.000s" in out and "warning 2.0 s, critical 4.0 s" in out
