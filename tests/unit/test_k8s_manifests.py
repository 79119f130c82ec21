"""deploy/k8s/base against the Kubernetes schemas, and the invariants the autoscaler relies on."""
from pathlib import Path

import kubernetes_validate
import yaml

from suite.autoscale_policy import POLICY_PATH, load_policy, prometheus_query

BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"
COLD_START_BUSY_S = 7.0
LONGEST_CALL_S = 600.0  # the gateway's downstream_timeout_s default


def _docs() -> list[dict]:
    files = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [d for f in files for d in yaml.safe_load_all((BASE / f).read_text()) if d]


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


def test_every_manifest_validates() -> None:
    docs = _docs()
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_inference_invariants() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    deploy = docs[("Deployment", "inference")]
    assert "replicas" not in deploy["spec"]
    pod = deploy["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > LONGEST_CALL_S
    startup = pod["containers"][0]["startupProbe"]
    assert "grpc" in startup
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2 * COLD_START_BUSY_S
    assert docs[("Service", "inference")]["spec"]["clusterIP"] == "None"


def test_only_the_gateway_is_exposed_and_backends_are_headless() -> None:
    services = {d["metadata"]["name"]: d["spec"] for d in _docs() if d["kind"] == "Service"}
    assert services["gateway"]["type"] == "LoadBalancer"
    for name in ("tokenizer", "inference"):
        assert services[name]["clusterIP"] == "None"
    assert all(spec.get("type", "ClusterIP") == "ClusterIP" for n, spec in services.items() if n != "gateway")


def test_inference_has_a_disruption_budget() -> None:
    pdbs = [d for d in _docs() if d["kind"] == "PodDisruptionBudget"]
    assert any(p["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "inference"} for p in pdbs)


def test_gateway_targets_resolve_the_headless_services() -> None:
    gateway = next(d for d in _docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
    env = {e["name"]: e["value"] for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AISERVE_GATEWAY_INFERENCE_ADDRESS"].startswith("dns:///inference:")
    assert env["AISERVE_GATEWAY_TOKENIZER_ADDRESS"].startswith("dns:///tokenizer:")


def test_scaled_object_expresses_the_policy() -> None:
    policy = yaml.safe_load(POLICY_PATH.read_text())
    path = BASE.parent / "components" / "keda" / "scaledobject.yaml"
    spec = yaml.safe_load(path.read_text())["spec"]
    assert spec["minReplicaCount"] == policy["replicas"]["min"]
    assert spec["maxReplicaCount"] == policy["replicas"]["max"]
    assert spec["cooldownPeriod"] == policy["keda"]["cooldown_period_s"]
    assert spec["pollingInterval"] == policy["keda"]["polling_interval_s"]
    assert spec["fallback"]["replicas"] == policy["keda"]["fallback_replicas"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == policy["scale_up"]["stabilization_window_s"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == policy["scale_down"]["stabilization_window_s"]
    trigger = spec["triggers"][0]
    assert policy["metric"]["name"] in trigger["metadata"]["query"]
    # The gauge has no model label: a label filter would match nothing and KEDA would never scale
    assert trigger["metadata"]["query"] == prometheus_query(load_policy())
    assert float(trigger["metadata"]["threshold"]) == policy["metric"]["target_per_replica"]


def _deployments() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == "Deployment"}


def test_every_service_has_resources_and_a_pre_stop_pause_before_its_drain() -> None:
    deployments = _deployments()
    assert set(deployments) == {"tokenizer", "inference", "cache", "gateway"}
    for name, deploy in deployments.items():
        container = deploy["spec"]["template"]["spec"]["containers"][0]
        assert set(container["resources"]) == {"requests", "limits"}, name
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0, name


def test_inference_memory_covers_the_weights_and_kv_cache_of_its_sizing() -> None:
    container = _deployments()["inference"]["spec"]["template"]["spec"]["containers"][0]
    gib = 1024**3
    weights = 2 * 256.6 * 1024**2  # bf16 weights, twice the model as load headroom
    kv = 64 * 2048 * 23_040  # 64 sequences x 2048 tokens x KV bytes per token (bf16)
    request = int(container["resources"]["requests"]["memory"].removesuffix("Gi")) * gib
    assert request >= weights + kv
    limit = int(container["resources"]["limits"]["memory"].removesuffix("Gi")) * gib
    assert limit > request


def test_the_model_store_is_one_volume_written_by_the_pull_job_and_mounted_read_only() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    assert ("PersistentVolumeClaim", "aiserve-models") in docs
    job = docs[("Job", "aiserve-models-pull")]["spec"]["template"]["spec"]
    assert job["containers"][0]["command"] == ["aiserve", "models", "pull"]
    for name in ("tokenizer", "inference"):
        pod = _deployments()[name]["spec"]["template"]["spec"]
        claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert {"claimName": "aiserve-models", "readOnly": True} in claims, name
        assert all(m["readOnly"] for m in pod["containers"][0]["volumeMounts"]), name
