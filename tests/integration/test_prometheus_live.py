"""The alert rules in a real Prometheus (Debian's package): it scrapes the four services of a
running suite, the inference service is killed, the "no healthy inference" alert becomes firing
through Prometheus' HTTP API, and it resolves once the service is back. And every metric the
Grafana dashboard queries is there.

The rules are deploy/prometheus/rules.yaml with every `for:` shortened to 1 s (the shipped
durations are minutes); the scrape and evaluation intervals are 1 s."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc import aio

from aiserve.store import ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from suite.runner import Suite, free_ports
from tests.integration.conftest import auth, config_for_tests, dev_key, eventually, run_suite
from tests.unit.test_dashboard import queried_metrics

ROOT = Path(__file__).resolve().parents[2]
ALERT = "AiserveNoHealthyInference"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def watched_suite(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    """A suite whose services serve metrics on free ports (the test suites' default is none)."""
    config = config_for_tests(tmp_path_factory.mktemp("aiserve-watched"), store.root)
    config.metrics_ports = dict(zip(config.metrics_ports, free_ports(len(config.metrics_ports)), strict=True))
    yield from run_suite(config)


@pytest.fixture(scope="module")
def prometheus(watched_suite: Suite, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server scraping the suite every second with the rules loaded; its base URL."""
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: `make test` installs Debian's prometheus package"
    folder = tmp_path_factory.mktemp("prometheus")
    rules = re.sub(r"\bfor: \S+", "for: 1s", (ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    (folder / "rules.yaml").write_text(rules)
    jobs = [{"job_name": f"aiserve-{name}", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for name, port in watched_suite.config.metrics_ports.items()]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["rules.yaml"],
              "scrape_configs": jobs}
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_ports(1)[0]
    process = subprocess.Popen(
        [exe, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(folder / "prometheus.log").open("wb"))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except OSError:
        return {}


def alert_state(base: str, name: str) -> str:
    """"firing", "pending" or "" (not active) for the alert ``name``."""
    alerts = get(f"{base}/api/v1/alerts").get("data", {}).get("alerts", [])
    states = {a["state"] for a in alerts if a["labels"]["alertname"] == name}
    return "firing" if "firing" in states else ("pending" if states else "")


def all_targets_up(base: str) -> bool:
    targets = get(f"{base}/api/v1/targets").get("data", {}).get("activeTargets", [])
    return len(targets) == 4 and all(t["health"] == "up" for t in targets)


async def test_killing_inference_fires_the_alert_and_recovery_resolves_it(watched_suite: Suite,
                                                                          prometheus: str) -> None:
    suite = watched_suite
    await eventually(lambda: all_targets_up(prometheus), TIMEOUT_S, "Prometheus scraping all four services")
    # Before the first samples the rule sees no replica at all, so it may fire at first (the
    # shipped rules wait a minute); with the replica's samples in, it must go quiet.
    await eventually(lambda: alert_state(prometheus, ALERT) == "", TIMEOUT_S, f"{ALERT} quiet while serving")
    serving = get(f"{prometheus}/api/v1/query?query=aiserve_serving").get("data", {}).get("result", [])
    assert {r["metric"]["job"]: r["value"][1] for r in serving}["aiserve-inference"] == "1"

    suite.kill("inference")  # SIGKILL: a crash
    await eventually(lambda: alert_state(prometheus, ALERT) == "firing", TIMEOUT_S, f"{ALERT} firing")

    suite.start_service("inference")  # the same ports as before
    await suite.wait_serving(("inference",), timeout_s=TIMEOUT_S)
    await eventually(lambda: alert_state(prometheus, ALERT) == "", TIMEOUT_S, f"{ALERT} resolved")


def declared_metrics(ports: list[int]) -> set[str]:
    """The metric families the services at ``ports`` declare (# TYPE lines; a counter is named
    without its _total there, so both spellings are included)."""
    declared: set[str] = set()
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            declared |= set(re.findall(r"^# TYPE (\S+) ", response.read().decode(), flags=re.MULTILINE))
    return declared | {f"{name}_total" for name in declared}


CUDA_ONLY = {"aiserve_inference_gpu_memory_allocated_bytes", "aiserve_inference_gpu_memory_reserved_bytes",
             "aiserve_inference_gpu_memory_total_bytes", "aiserve_inference_gpu_utilization_ratio"}
"""Exported by inference replicas on CUDA only (this suite runs on the CPU)."""


async def test_every_metric_the_dashboard_queries_is_exported_by_the_running_suite(watched_suite: Suite,
                                                                                    prometheus: str) -> None:
    """Every metric a dashboard panel queries is declared on some service's /metrics (a labelled
    counter with no child yet, like canary rollbacks, has its # TYPE line and no sample), and,
    after one generation and one feedback through the gateway, the ones that have samples reach
    the Prometheus that scrapes the suite."""
    suite = watched_suite
    await suite.wait_serving(timeout_s=TIMEOUT_S)
    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=4))
    request.chat.messages.add(role="user", content="Say hi.")
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = await stub.Complete(request, timeout=TIMEOUT_S, metadata=auth(dev_key(suite)))
        await stub.SubmitFeedback(gateway_pb2.FeedbackRequest(request_id=reply.request_id, rating=1),
                                  timeout=TIMEOUT_S, metadata=auth(dev_key(suite)))
    declared = await asyncio.to_thread(declared_metrics, list(suite.config.metrics_ports.values()))
    wanted = queried_metrics() - CUDA_ONLY
    assert not wanted - declared

    def unscraped() -> set[str]:
        names = set(get(f"{prometheus}/api/v1/label/__name__/values").get("data", []))
        return {m for m in wanted - {"aiserve_gateway_canary_rollbacks_total"}
                if m not in names and f"{m}_bucket" not in names}

    try:
        await eventually(lambda: not unscraped(), 60, "every dashboard metric with a sample scraped")
    finally:
        assert not unscraped()
