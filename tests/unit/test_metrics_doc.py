"""docs/metrics.md lists exactly the aiserve_* metrics the code defines, under their exported names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("aiserve/**/*.py"), *ROOT.glob("services/**/*.py")]
KINDS = "Counter|Gauge|Histogram|Summary|CounterMetricFamily|GaugeMetricFamily|HistogramMetricFamily"
# A metric's constructor and its first argument: a literal name, or `p + "name"` after `p = "prefix"`
DEFINITION = re.compile(rf'\b({KINDS})\(\s*(?:(\w+) \+ )?"(aiserve_\w*|\w+)"')


def exported(kind: str, name: str) -> str:
    """The name Prometheus text carries: counters end in _total (prometheus_client adds it)."""
    if kind.startswith("Counter") and not name.endswith("_total"):
        return name + "_total"
    return name


def defined_in_code() -> set[str]:
    names = set()
    for path in SOURCES:
        text = path.read_text()
        prefixes = dict(re.findall(r'^\s*(\w+) = "(aiserve_\w*)"', text, re.M))
        for kind, var, name in DEFINITION.findall(text):
            full = (prefixes[var] + name) if var else name
            if full.startswith("aiserve_"):
                names.add(exported(kind, full))
    return names


def documented() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(aiserve_\w+)` \|", text, re.M))


def test_the_scan_finds_the_metrics_of_every_service() -> None:
    """The scan itself works: one known metric of each service and of the shared server."""
    names = defined_in_code()
    for known in ("aiserve_rpc_total", "aiserve_gateway_requests_total", "aiserve_inference_queue_length",
                  "aiserve_inference_steps_total", "aiserve_inference_probe_failures_total", "aiserve_cache_entries"):
        assert known in names


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    code, doc = defined_in_code(), documented()
    assert code - doc == set(), f"defined in the code but not in docs/metrics.md: {sorted(code - doc)}"
    assert doc - code == set(), f"in docs/metrics.md but not defined in the code: {sorted(doc - code)}"
