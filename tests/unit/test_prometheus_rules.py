"""deploy/prometheus/rules.yaml is valid Prometheus and each alert fires and stays quiet when it
should (promtool's own unit tests, deploy/prometheus/rules_test.yaml); every alert has a runbook."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: `make test` installs Debian's prometheus package"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_the_rules_are_valid_prometheus() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_stays_quiet_as_its_cases_say() -> None:
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_both_a_firing_and_a_quiet_case() -> None:
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired, quiet = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
            # a case that lists some instances firing is quiet for the others it feeds
            if check["exp_alerts"] and len({s["series"].split("instance=")[-1] for s in case["input_series"]}) > \
                    len({a["exp_labels"].get("instance") for a in check["exp_alerts"]}):
                quiet.add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert fired == names
    assert quiet == names


def test_every_alert_has_two_levels_or_is_a_single_event_and_a_runbook_section() -> None:
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    sections = {m.lower() for m in re.findall(r"^## (\w+)$", runbook, re.M)}
    for alert in alerts():
        assert alert["labels"]["severity"] in ("warning", "critical")
        anchor = alert["annotations"]["runbook"].split("#")[1]
        assert anchor in sections, f"docs/runbook.md has no section {alert['alert']}"


def test_the_local_scrape_config_is_valid_and_names_the_jobs_the_rules_expect() -> None:
    config = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {c["job_name"] for c in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {f"aiserve-{name}" for name in ("gateway", "tokenizer", "inference", "cache")}


def test_the_ttft_alert_uses_the_gateway_default_target() -> None:
    from services.gateway.config import GatewayConfig

    target = GatewayConfig().slo_ttft_s
    thresholds = {a["labels"]["severity"]: float(a["expr"].rsplit(">", 1)[1]) for a in alerts()
                  if a["alert"] == "AiserveTTFTOverTarget"}
    assert thresholds == {"warning": target, "critical": 2 * target}
