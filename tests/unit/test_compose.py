"""The container files, checked without a Docker engine (none runs on the development machines).

compose.yaml is validated against the Compose Specification's JSON schema (tests/data, a copy
of compose-spec/compose-spec's schema) and checked for the properties the suite relies on; the
Dockerfile for a pinned base image and the locked dependencies; the health probe the compose
health checks run, against a real gRPC health service; the `monitoring` profile (Prometheus and
Grafana: off by default, on the loopback only, scraping every service's metrics port, the alert
rules and the dashboard mounted).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from aiserve import healthprobe
from aiserve.common.server import ServiceHandle, new_server
from aiserve.store import DEFAULT_MODEL
from suite.config import DEFAULT_METRICS_PORTS, DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("tokenizer", "inference", "cache")
LONG_RUNNING = (*BACKENDS, "gateway")
PORTS = DEFAULT_PORTS
"""Compose runs each service on its own default port (its config class declares it)."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    assert "draft-07" in schema["$schema"]  # so Draft7Validator is the right class
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def default_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What a plain `docker compose up` starts: the services in no profile."""
    return {name: svc for name, svc in services(compose).items() if not svc.get("profiles")}


def test_compose_matches_the_compose_specification(
    compose: dict[str, Any], validator: jsonschema.protocols.Validator
) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_schema_check_is_not_vacuous(
    compose: dict[str, Any], validator: jsonschema.protocols.Validator
) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["portz"] = ["50051:50051"]
    broken["services"]["cache"]["depends_on"] = {"models": {"condition": "when_ready"}}
    assert len(list(validator.iter_errors(broken))) == 2


def test_only_the_gateway_publishes_ports(compose: dict[str, Any]) -> None:
    published = {name for name, svc in default_services(compose).items() if svc.get("ports")}
    assert published == {"gateway"}
    assert [str(p).split(":")[-1] for p in services(compose)["gateway"]["ports"]] == ["50051", "8000"]


def test_backends_are_only_on_the_internal_network(compose: dict[str, Any]) -> None:
    networks = compose["networks"]
    internal = {name for name, net in networks.items() if (net or {}).get("internal") is True}
    assert internal == {"backend"}
    for name in BACKENDS:
        assert services(compose)[name]["networks"] == ["backend"], name
    assert set(services(compose)["gateway"]["networks"]) == {"backend", "frontend"}
    assert not (networks["frontend"] or {}).get("internal")
    assert services(compose)["models"]["network_mode"] == "none"


def test_every_long_running_service_has_a_health_probe_on_its_port(compose: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        svc = services(compose)[name]
        assert svc["healthcheck"]["test"] == [
            "CMD", "python", "-m", "aiserve.healthprobe", f"127.0.0.1:{PORTS[name]}"], name
        command = svc["command"]
        assert command[:3] == ["python", "-m", f"services.{name}"], name
        assert command[command.index("--host") + 1] == "0.0.0.0", name
        assert command[command.index("--port") + 1] == str(PORTS[name]), name


def test_start_order_waits_for_the_model_and_for_health(compose: dict[str, Any]) -> None:
    def conditions(name: str) -> dict[str, str]:
        return {dep: spec["condition"] for dep, spec in services(compose)[name].get("depends_on", {}).items()}

    assert services(compose)["models"]["command"] == ["aiserve", "models", "pull"]
    for name in ("tokenizer", "inference"):
        assert conditions(name) == {"models": "service_completed_successfully"}
    assert conditions("gateway") == {name: "service_healthy" for name in BACKENDS}
    command = services(compose)["gateway"]["command"]
    for name in BACKENDS:
        flag = f"--{name}-address"
        assert command[command.index(flag) + 1] == f"{name}:{PORTS[name]}"


def test_every_service_shares_the_volume_at_data(compose: dict[str, Any]) -> None:
    assert "aiserve-data" in compose["volumes"]
    assert set(default_services(compose)) == {"models", *LONG_RUNNING}
    for name, svc in default_services(compose).items():
        assert "aiserve-data:/data" in svc["volumes"], name
        assert svc["environment"]["AISERVE_HOME"] == "/data", name
        assert svc["image"] == "aiserve:0.1.0", name
    assert "AISERVE_INFERENCE_TORCH_THREADS" in services(compose)["inference"]["environment"]


def test_dockerfile_base_image_is_pinned(dockerfile: str) -> None:
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert froms == ["python:3.11.7-slim-bookworm"]
    _, _, tag = froms[0].partition(":")
    assert tag and "latest" not in tag
    assert re.match(r"^3\.11\.\d+-", tag), tag


def test_dockerfile_installs_the_lock_with_the_cpu_torch_index(dockerfile: str) -> None:
    runs = " ".join(line for line in dockerfile.replace("\\\n", " ").splitlines() if line.startswith("RUN"))
    # The torch index is a build argument (the CUDA image of deploy/k8s/overlays/cuda) whose default is the CPU one.
    assert re.search(r"^ARG TORCH_CHANNEL=cpu$", dockerfile, flags=re.MULTILINE)
    assert re.search(r"pip install [^&]*--extra-index-url https://download\.pytorch\.org/whl/\$\{TORCH_CHANNEL\}"
                     r" -r requirements\.lock", runs)
    assert "scripts/gen_protos.py" in runs
    assert "pip install --no-deps -e ." in runs
    assert re.search(r"^USER (?!root|0\b)\S+", dockerfile, flags=re.MULTILINE)
    assert re.search(r"HF_HUB_OFFLINE=1", dockerfile)
    assert re.search(r"AISERVE_HOME=/data", dockerfile)
    # The model wheel baked into the image is the one aiserve.store pins.
    assert f"ARG MODEL_WHEEL={DEFAULT_MODEL.requirement}\n" in dockerfile


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "var", ".git", "aiserve/v1"} <= ignored


@pytest.fixture
async def health_server() -> AsyncIterator[ServiceHandle]:
    handle = new_server("probe-test", [], "127.0.0.1", 0)
    try:
        await handle.start()
        yield handle
    finally:
        await handle.stop(0)


async def test_healthprobe_exits_0_only_when_serving(
    health_server: ServiceHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    # The probe is synchronous gRPC: run it off the event loop that serves the health service.
    address = f"127.0.0.1:{health_server.port}"
    assert await asyncio.to_thread(healthprobe.main, [address, "--timeout", "5"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    await health_server.set_serving(True)
    assert await asyncio.to_thread(healthprobe.main, [address, "--timeout", "5"]) == 0
    assert await asyncio.to_thread(healthprobe.main, [address, "--service", "nope", "--timeout", "5"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_healthprobe_fails_with_one_line_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    assert healthprobe.main(["127.0.0.1:1", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UNAVAILABLE" in err


# The `monitoring` profile: Prometheus and Grafana, started only on request.
MONITORING = ("prometheus", "grafana")
PROMETHEUS_DIR = "/etc/prometheus"


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (resolved from the repository root) of each bind mount."""
    found = {}
    for volume in svc["volumes"]:
        source, target = str(volume).split(":")[:2]
        if source.startswith("./"):
            found[target] = str((ROOT / source).resolve())
    return found


def test_the_monitoring_profile_is_not_started_by_default(compose: dict[str, Any]) -> None:
    profiled = {name for name, svc in services(compose).items() if svc.get("profiles")}
    assert profiled == set(MONITORING)
    for name in MONITORING:
        assert services(compose)[name]["profiles"] == ["monitoring"], name
    for name, svc in default_services(compose).items():  # nothing by default may need them
        assert not set(svc.get("depends_on", {})) & set(MONITORING), name


def test_monitoring_publishes_on_the_loopback_only(compose: dict[str, Any]) -> None:
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        assert services(compose)[name]["ports"] == [f"127.0.0.1:{port}:{port}"], name
        assert ":latest" not in services(compose)[name]["image"] and ":" in services(compose)[name]["image"]
    assert not (compose["networks"]["monitoring"] or {}).get("internal")  # a port needs a routable network
    assert "monitoring" not in services(compose)["gateway"]["networks"]


def _prometheus_config(compose: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    prometheus = services(compose)["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    host = Path(mounts(prometheus)[config_path])
    return yaml.safe_load(host.read_text()), host


def test_prometheus_scrapes_each_service_on_its_metrics_port(compose: dict[str, Any]) -> None:
    config, _ = _prometheus_config(compose)
    local = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert set(jobs) == {job["job_name"] for job in local["scrape_configs"]}  # the alert rules' job names
    assert jobs == {f"aiserve-{name}": [f"{name}:{DEFAULT_METRICS_PORTS[name]}"] for name in LONG_RUNNING}
    for name in LONG_RUNNING:  # each listens on all interfaces, on its default metrics port
        svc = services(compose)[name]
        assert f"AISERVE_{name.upper()}_METRICS_PORT" not in svc.get("environment", {}), name
        assert not set(svc["networks"]).isdisjoint(services(compose)["prometheus"]["networks"]), name


def test_prometheus_loads_the_alert_rules_and_its_config_is_valid(compose: dict[str, Any]) -> None:
    config, host = _prometheus_config(compose)
    mounted = mounts(services(compose)["prometheus"])
    rules = ROOT / "deploy" / "prometheus" / "rules.yaml"
    assert [mounted[f"{PROMETHEUS_DIR}/{f}"] for f in config["rule_files"]] == [str(rules)]
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs Debian's prometheus package"
    # The host layout mirrors the container's (rules.yaml beside the config), so promtool reads the rules too.
    result = subprocess.run([promtool, "check", "config", str(host)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0 and "1 rule files found" in result.stdout, result.stdout + result.stderr


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = mounts(services(compose)["grafana"])
    provisioning = Path(grafana["/etc/grafana/provisioning"])
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"  # the compose service, on the port it publishes
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "aiserve.yaml").read_text())["providers"]
    dashboard = Path(grafana[provider["options"]["path"] + "/aiserve.json"])
    assert dashboard == ROOT / "deploy" / "grafana" / "aiserve.json"
    # Provisioning gets no import inputs: the panels' ${DS_PROMETHEUS} must be a data source variable.
    model = json.loads(dashboard.read_text())
    placeholders = set(re.findall(r"\$\{(\w+)\}", json.dumps([p["datasource"] for p in model["panels"]])))
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert placeholders == {"DS_PROMETHEUS"}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
