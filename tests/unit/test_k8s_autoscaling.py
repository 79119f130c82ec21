"""The two autoscalers of deploy/k8s/components (KEDA, and the HPA read through prometheus-adapter)
state exactly deploy/autoscaling/policy.yaml; the ScaledObject is valid against KEDA's own CRD
schema (vendored in deploy/k8s/schemas) and the HPA against Kubernetes', and both checks reject a
misspelled field."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from suite.autoscale_policy import POLICY_PATH, load_policy, prometheus_query, rate_query
from suite.crd_schema import SCHEMAS, cel_rules, errors, load_crd

COMPONENTS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "components"
CRD = SCHEMAS / "keda.sh_scaledobjects.yaml"
MIN_MAX_RULE = ("!has(self.minReplicaCount) || self.minReplicaCount <= "
                "(has(self.maxReplicaCount) ? self.maxReplicaCount : 100)")
# The fields of prometheus-adapter's DiscoveryRule and ResourceMapping (pkg/config/config.go).
ADAPTER_RULE_FIELDS = {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
ADAPTER_RESOURCE_FIELDS = {"template", "overrides", "namespaced"}


def _yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def scaled_object() -> dict[str, Any]:
    return _yaml(COMPONENTS / "keda" / "scaledobject.yaml")


@pytest.fixture(scope="module")
def hpa() -> dict[str, Any]:
    return _yaml(COMPONENTS / "hpa" / "hpa.yaml")


@pytest.fixture(scope="module")
def adapter_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = _yaml(COMPONENTS / "hpa" / "prometheus-adapter-values.yaml")["rules"]["external"]
    return rules


def policy_terms() -> dict[str, Any]:
    """deploy/autoscaling/policy.yaml in the terms both autoscalers share."""
    raw = _yaml(POLICY_PATH)
    up, down = raw["scale_up"], raw["scale_down"]
    return {
        "min": raw["replicas"]["min"], "max": raw["replicas"]["max"],
        # The query yields the mean per replica, so the target must be a Value: the HPA then scales
        # to ceil(replicas * mean / target), the policy's formula (suite/autoscale_policy.py).
        "triggers": [(prometheus_query(load_policy()), ("Value", float(raw["metric"]["target_per_replica"]))),
                     (rate_query(load_policy()), ("AverageValue", float(raw["rate_metric"]["target_per_replica"])))],
        "behavior": {
            "scaleUp": {"stabilizationWindowSeconds": up["stabilization_window_s"], "selectPolicy": "Max",
                        "policies": [
                            {"type": "Percent", "value": up["max_percent_per_period"], "periodSeconds": up["period_s"]},
                            {"type": "Pods", "value": up["max_pods_per_period"], "periodSeconds": up["period_s"]}]},
            "scaleDown": {"stabilizationWindowSeconds": down["stabilization_window_s"],
                          "policies": [{"type": "Pods", "value": down["max_pods_per_period"],
                                        "periodSeconds": down["period_s"]}]},
        },
    }


def keda_terms(scaled_object: dict[str, Any]) -> dict[str, Any]:
    spec = scaled_object["spec"]
    assert all(t["type"] == "prometheus" for t in spec["triggers"])
    return {
        "min": spec["minReplicaCount"], "max": spec["maxReplicaCount"],
        "triggers": [(t["metadata"]["query"], (t.get("metricType", "AverageValue"), float(t["metadata"]["threshold"])))
                     for t in spec["triggers"]],
        "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
    }


def adapter_query(rules: list[dict[str, Any]], metric: str) -> str:
    """The PromQL the adapter sends for ``metric`` with no label selector: its Go template filled in
    with the series name and no label matchers (the rule is not namespaced, so none are added)."""
    (rule,) = [r for r in rules if r["name"]["as"] == metric]
    assert rule["resources"] == {"namespaced": False}
    assert re.fullmatch(rule["name"]["matches"], rule["seriesQuery"])
    assert rule["name"]["as"] == metric
    return rule["metricsQuery"].replace("<<.Series>>", rule["seriesQuery"]).replace("<<.LabelMatchers>>", "")


def hpa_terms(hpa: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
    spec = hpa["spec"]
    assert all(m["type"] == "External" for m in spec["metrics"])
    targets = [m["external"]["target"] for m in spec["metrics"]]
    return {
        "min": spec["minReplicas"], "max": spec["maxReplicas"],
        "triggers": [(adapter_query(rules, m["external"]["metric"]["name"]),
                      (t["type"], float(t[{"Value": "value", "AverageValue": "averageValue"}[t["type"]]])))
                     for m, t in zip(spec["metrics"], targets, strict=True)],
        "behavior": spec["behavior"],
    }


def test_keda_and_the_hpa_state_the_same_policy(
    scaled_object: dict[str, Any], hpa: dict[str, Any], adapter_rules: list[dict[str, Any]]
) -> None:
    expected = policy_terms()
    assert keda_terms(scaled_object) == expected
    assert hpa_terms(hpa, adapter_rules) == expected


def test_the_policy_comparison_notices_a_drift(
    scaled_object: dict[str, Any], hpa: dict[str, Any], adapter_rules: list[dict[str, Any]]
) -> None:
    slower = copy.deepcopy(hpa)
    slower["spec"]["behavior"]["scaleDown"]["policies"][0]["periodSeconds"] = 120
    assert hpa_terms(slower, adapter_rules) != policy_terms()
    per_pod = copy.deepcopy(scaled_object)
    per_pod["spec"]["triggers"][0]["metricType"] = "AverageValue"
    assert keda_terms(per_pod) != policy_terms()


def test_both_scale_the_inference_deployment(scaled_object: dict[str, Any], hpa: dict[str, Any]) -> None:
    assert scaled_object["spec"]["scaleTargetRef"]["name"] == "inference"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inference"}


def test_the_adapter_rules_use_only_fields_the_adapter_reads(adapter_rules: list[dict[str, Any]]) -> None:
    assert len(adapter_rules) == 2
    for rule in adapter_rules:
        assert set(rule) <= ADAPTER_RULE_FIELDS
        assert set(rule["resources"]) <= ADAPTER_RESOURCE_FIELDS
        assert set(rule["name"]) == {"matches", "as"}


def test_the_vendored_crd_is_kedas_scaled_object_v1alpha1() -> None:
    crd = load_crd(CRD)
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh"
    assert crd["spec"]["names"]["kind"] == "ScaledObject"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    header = CRD.read_text().split("\n---", 1)[0]
    assert re.search(r"from KEDA\s+#?\s*v2\.\d+\.\d+ ", header)  # the header names the release


def test_the_scaled_object_is_valid_against_the_keda_crd(scaled_object: dict[str, Any]) -> None:
    assert errors(scaled_object, load_crd(CRD)) == []


def test_the_crds_cel_rules_are_the_ones_checked_here(scaled_object: dict[str, Any]) -> None:
    """jsonschema cannot run CEL: the CRD's one rule is checked by hand, and a KEDA update that adds
    a rule fails here until it is checked too."""
    assert cel_rules(load_crd(CRD), "v1alpha1") == [MIN_MAX_RULE]
    assert scaled_object["spec"]["minReplicaCount"] <= scaled_object["spec"]["maxReplicaCount"]


@pytest.mark.parametrize(("path", "value", "error"), [
    (("spec", "minReplicaCont"), 1, "'minReplicaCont' was unexpected"),
    (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp", "stabilisationWindowSeconds"),
     0, "'stabilisationWindowSeconds' was unexpected"),
    (("spec", "triggers", 0, "metadata", "threshold"), 8, "8 is not of type 'string'"),
    (("spec", "pollingInterval"), 0, "0 is less than the minimum of 1"),
    (("apiVersion",), "keda.sh/v1", "no version 'v1'"),
])
def test_the_crd_check_rejects_a_broken_copy(
    scaled_object: dict[str, Any], path: tuple[Any, ...], value: Any, error: str
) -> None:
    broken = copy.deepcopy(scaled_object)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        found = errors(broken, load_crd(CRD))
    except ValueError as exc:  # an apiVersion the CRD does not serve
        found = [str(exc)]
    assert any(error in message for message in found), found


def test_the_hpa_is_valid_kubernetes_and_a_misspelled_field_is_not(hpa: dict[str, Any]) -> None:
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    broken = copy.deepcopy(hpa)
    broken["spec"]["behavior"]["scaleUp"]["stabilisationWindowSeconds"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30", strict=True)
