"""``aiserve alerts thresholds``: alert thresholds proposed from what was observed, as the
source of our operating practice asks (thresholds from history, not guesses).

Two sources of history:

- a benchmark's JSON (``--bench bench/results/peers.json``, ``http.json``, ...): every
  ``ttft`` and ``time_per_token``/``inter_token`` summary in it with a ``p99_ms``; the worst p99
  observed is the baseline;
- a Prometheus server (``--prometheus http://host:9090 --days 7``): the gateway's TTFT and
  time-per-token p99 over the range (``query_range`` of ``histogram_quantile``), whose highest
  point is the baseline.

The proposal is ``factor`` (1.5 by default) times the baseline for the warning level and twice
that for the critical one, printed beside the thresholds now in deploy/prometheus/rules.yaml.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_FACTOR = 1.5
FIGURES = {"ttft": ("ttft",), "tpot": ("time_per_token", "inter_token")}
"""Each proposed threshold and the summary keys a bench JSON reports it under."""
QUERIES = {
    "ttft": "histogram_quantile(0.99, sum(rate(aiserve_gateway_ttft_seconds_bucket"
            '{job="aiserve-gateway"}[5m])) by (le))',
    "tpot": "histogram_quantile(0.99, sum(rate(aiserve_gateway_time_per_output_token_seconds_bucket"
            '{job="aiserve-gateway"}[5m])) by (le))',
}


@dataclass(frozen=True, slots=True)
class Proposal:
    figure: str
    observed_p99_s: float
    warning_s: float
    critical_s: float


def propose(figure: str, observed_p99_s: float, factor: float = DEFAULT_FACTOR) -> Proposal:
    """``factor`` x the observed p99 warns, twice that pages."""
    if not observed_p99_s > 0 or not factor > 1:
        raise ValueError(f"need an observed p99 > 0 and a factor > 1, got {observed_p99_s} and {factor}")
    warning = round(observed_p99_s * factor, 3)
    return Proposal(figure, observed_p99_s, warning, round(2 * warning, 3))


def _summaries(node: Any, keys: tuple[str, ...]) -> Iterator[float]:
    """Every ``p99_ms`` under one of ``keys`` anywhere in a bench JSON, in seconds."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys and isinstance(value, dict) and isinstance(value.get("p99_ms"), int | float):
                yield value["p99_ms"] / 1000
            else:
                yield from _summaries(value, keys)
    elif isinstance(node, list):
        for value in node:
            yield from _summaries(value, keys)


def from_bench(data: Any) -> dict[str, float]:
    """The worst p99 of each figure found in a bench JSON (figures it lacks are left out)."""
    found = {}
    for figure, keys in FIGURES.items():
        values = list(_summaries(data, keys))
        if values:
            found[figure] = max(values)
    return found


def from_prometheus_result(response: dict[str, Any]) -> float | None:
    """The highest finite point of a ``query_range`` answer (None when it has none)."""
    if response.get("status") != "success":
        raise ValueError(f"Prometheus answered {response.get('status')}: {response.get('error', '')}")
    points = [float(v) for series in response["data"]["result"] for _, v in series["values"]]
    finite = [p for p in points if math.isfinite(p)]
    return max(finite) if finite else None


def query_range(base_url: str, query: str, days: float, timeout_s: float = 30.0) -> dict[str, Any]:
    """Prometheus' HTTP API: ``query`` over the last ``days`` at a step of ~1,000 points."""
    end = time.time()
    start = end - days * 86_400
    params = urllib.parse.urlencode({"query": query, "start": start, "end": end,
                                     "step": max(15, int((end - start) / 1000))})
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout_s) as r:
        result: dict[str, Any] = json.load(r)
        return result


def current_thresholds(rules: Path) -> dict[str, dict[str, float]]:
    """The TTFT thresholds in the rules file, by severity (the other alerts are not latency)."""
    import yaml

    found: dict[str, dict[str, float]] = {}
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "AiserveTTFTOverTarget":
                found.setdefault("ttft", {})[rule["labels"]["severity"]] = float(rule["expr"].rsplit(">", 1)[1])
    return found


def cmd_thresholds(args: argparse.Namespace) -> int:
    if args.bench:
        observed = from_bench(json.loads(Path(args.bench).read_text()))
    else:
        observed = {}
        for figure, query in QUERIES.items():
            value = from_prometheus_result(query_range(args.prometheus, query, args.days))
            if value is not None:
                observed[figure] = value
    if not observed:
        print("aiserve: no TTFT or time-per-token p99 found in that history")
        return 1
    now = current_thresholds(Path(args.rules))
    print(f"{'figure':8} {'observed p99':>13} {'warning':>9} {'critical':>9}   now in {args.rules}")
    for figure, p99 in observed.items():
        p = propose(figure, p99, args.factor)
        current = now.get(figure)
        shown = f"warning {current['warning']} s, critical {current['critical']} s" if current else "(no alert)"
        print(f"{figure:8} {p.observed_p99_s:>12.3f}s {p.warning_s:>8.3f}s {p.critical_s:>8.3f}s   {shown}")
    return 0


def add_alerts_command(sub: Any) -> None:
    alerts = sub.add_parser("alerts", help="alert thresholds from observed history")
    commands = alerts.add_subparsers(dest="alerts_command", required=True)
    thresholds = commands.add_parser("thresholds", help="propose thresholds from a bench JSON or Prometheus")
    source = thresholds.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench", help="a benchmark's JSON (bench/results/*.json)")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server's base URL")
    thresholds.add_argument("--days", type=float, default=7.0, help="history to read from Prometheus")
    thresholds.add_argument("--factor", type=float, default=DEFAULT_FACTOR, help="warning = factor x observed p99")
    thresholds.add_argument("--rules", default=str(Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
                                                   / "rules.yaml"))
    thresholds.set_defaults(func=cmd_thresholds)
