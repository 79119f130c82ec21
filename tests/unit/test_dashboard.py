"""deploy/grafana/aiserve.json is what suite/dashboard.py builds, and queries only metrics that exist."""

from __future__ import annotations

import json
import re

from suite.dashboard import OUT, PANELS, render
from tests.unit.test_metrics_doc import documented

FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "by", "le"}


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert OUT.read_text() == render(), "run `python -m suite.dashboard` and commit deploy/grafana/aiserve.json"


def test_every_panel_has_queries_and_the_file_is_valid_json() -> None:
    model = json.loads(OUT.read_text())
    assert len(model["panels"]) == len(PANELS)
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"]) for panel in model["panels"])


def queried_metrics() -> set[str]:
    """Every metric name the dashboard's panels query (histograms by their base name)."""
    queried = set()
    for _, _, targets in PANELS:
        for _, expr in targets:
            without_labels = re.sub(r"\{[^}]*\}|\[[^]]*\]|\([^()]*\bby\b[^()]*\)", " ", expr)
            for name in re.findall(r"\b([a-z_]+_[a-z_]+)\b", without_labels):
                queried.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return queried - FUNCTIONS


def test_every_metric_a_panel_queries_is_exported() -> None:
    exported = documented() | {"process_resident_memory_bytes"}
    queried = queried_metrics()
    assert queried, "the scan found no metric"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
