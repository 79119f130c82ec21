"""The Grafana dashboard of aiserve, generated from code: ``python -m suite.dashboard`` writes
deploy/grafana/aiserve.json (tests/unit/test_dashboard.py checks the file is what this builds and
that every metric a panel queries is one the services export, docs/metrics.md).

Panels read a Prometheus data source chosen on import (the ``DS_PROMETHEUS`` input); the jobs are
named aiserve-<service> as in deploy/prometheus/prometheus.yml. A provisioned dashboard (the compose
``monitoring`` profile) gets no import inputs, so ``DS_PROMETHEUS`` is also a data source variable,
which resolves to the default Prometheus data source there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "aiserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# The data source variable that ${DS_PROMETHEUS} names when no import input replaced it.
DATASOURCE_VARIABLE = {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                       "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
                       "regex": ""}
GATEWAY_CALLS = 'aiserve_rpc_total{service="gateway"}'


def _quantiles(bucket: str, selector: str) -> list[tuple[str, str]]:
    return [(f"p{q}", f"histogram_quantile(0.{q}, sum(rate({bucket}{{{selector}}}[5m])) by (le))")
            for q in ("50", "95", "99")]


# (title, unit, [(legend, PromQL)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Gateway calls by method", "reqps", [("{{method}}", f"sum(rate({GATEWAY_CALLS}[5m])) by (method)")]),
    ("Gateway calls by status code (not OK)", "reqps",
     [("{{code}}", 'sum(rate(aiserve_rpc_total{service="gateway",code!="OK"}[5m])) by (code)')]),
    ("Time to first token (p50/p95/p99)", "s",
     _quantiles("aiserve_gateway_ttft_seconds_bucket", 'job="aiserve-gateway"')),
    ("Time per output token (p50/p95/p99)", "s",
     _quantiles("aiserve_gateway_time_per_output_token_seconds_bucket", 'job="aiserve-gateway"')),
    ("Generate end to end (p50/p95/p99)", "s",
     _quantiles("aiserve_rpc_seconds_bucket", 'service="gateway",method=~"Generate|Complete"')),
    ("Inference queue and running batch", "short",
     [("waiting {{instance}}", "aiserve_inference_queue_length"),
      ("running {{instance}}", "aiserve_inference_running")]),
    ("KV cache in use", "percentunit",
     [("{{instance}}", "aiserve_inference_kv_used_bytes / aiserve_inference_kv_total_bytes")]),
    ("Tokens per second", "short",
     [("generated {{instance}}", "rate(aiserve_inference_generated_tokens_total[5m])"),
      ("billed {{kind}}", "sum(rate(aiserve_gateway_tokens_total[5m])) by (kind)")]),
    ("Cache hit rate", "percentunit",
     [("hits", 'sum(rate(aiserve_gateway_cache_lookups_total{outcome=~"hit|hit_cancelled"}[5m]))'
               " / sum(rate(aiserve_gateway_cache_lookups_total[5m]))")]),
    ("Cost by tenant tier (per hour)", "short",
     [("{{tier}}", "sum(increase(aiserve_gateway_cost_micros_total[1h])) by (tier) / 1e6")]),
    ("Serving instances by service", "short", [("{{job}}", "sum(aiserve_serving) by (job)")]),
    ("Answers by model@version (canary vs stable)", "reqps",
     [("{{model}}", "sum(rate(aiserve_gateway_requests_total[5m])) by (model)"),
      ("rolled back {{model}}", "increase(aiserve_gateway_canary_rollbacks_total[15m])")]),
    ("Speculative drafts accepted", "percentunit",
     [("{{instance}}", "rate(aiserve_inference_accepted_draft_tokens_total[5m])"
                       " / rate(aiserve_inference_draft_tokens_total[5m])")]),
    ("Resident memory by service", "bytes",
     [("{{job}} {{instance}}", 'process_resident_memory_bytes{job=~"aiserve-.*"}')]),
    # Every gateway reports the same replicas: max, not sum, over the gateways.
    ("Healthy replicas by model@version", "short",
     [("SERVING {{service}} {{model}}", "max(aiserve_gateway_healthy_replicas) by (model, service)"),
      ("known {{service}} {{model}}", "max(aiserve_gateway_replicas) by (model, service)")]),
    ("Generations by status code and tier (gRPC and HTTP)", "reqps",
     [("{{code}} {{tier}}", "sum(rate(aiserve_gateway_calls_total[5m])) by (code, tier)")]),
    ("Failed generations by model@version", "reqps",
     [("{{code}} {{model}}", 'sum(rate(aiserve_gateway_calls_total{code!~"OK|CANCELLED"}[5m])) by (model, code)')]),
    ("Tokens billed by tier", "short",
     [("{{kind}} {{tier}}", "sum(rate(aiserve_gateway_tokens_total[5m])) by (kind, tier)")]),
    ("Feedback by kind (per hour)", "short",
     [("{{kind}}", "sum(increase(aiserve_gateway_feedback_total[1h])) by (kind)")]),
    ("Engine step time (p50/p95/p99)", "s",
     _quantiles("aiserve_inference_step_seconds_bucket", 'job="aiserve-inference"')),
    ("Tokens per engine step (mean)", "short",
     [("{{model}}", "sum(rate(aiserve_inference_step_tokens_sum[5m])) by (model)"
                    " / sum(rate(aiserve_inference_step_tokens_count[5m])) by (model)")]),
    ("Inference health checks passing", "short",
     [("{{model}}", "sum(aiserve_inference_health_check_passed) by (model)")]),
    ("GPU memory (CUDA replicas)", "bytes",
     [("allocated {{instance}}", "aiserve_inference_gpu_memory_allocated_bytes"),
      ("reserved {{instance}}", "aiserve_inference_gpu_memory_reserved_bytes"),
      ("total {{instance}}", "aiserve_inference_gpu_memory_total_bytes")]),
    ("GPU utilisation (CUDA replicas)", "percentunit",
     [("{{instance}}", "aiserve_inference_gpu_utilization_ratio")]),
]


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model: one time-series panel per entry of PANELS, two a row."""
    panels = []
    for index, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": index + 1, "type": "timeseries", "title": title, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                        for i, (legend, expr) in enumerate(targets)],
        })
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "aiserve", "uid": "aiserve", "tags": ["aiserve"], "timezone": "utc", "schemaVersion": 39,
        "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [DATASOURCE_VARIABLE]}, "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> None:
    OUT.write_text(render())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
