"""deploy/k8s/base against the Kubernetes schemas, and the invariants the autoscaler relies on."""
from pathlib import Path

import kubernetes_validate
import yaml

BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"
COLD_START_BUSY_S = 7.0
LONGEST_CALL_S = 600.0  # the gateway's downstream_timeout_s default


def _docs() -> list[dict]:
    return [d for f in sorted(BASE.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


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
