"""deploy/k8s/overlays/{cpu,cuda}, rendered over the base (suite/kustomize.py, no kustomize binary
needed) and validated: every built-in object against the Kubernetes schemas, the inference
settings through the inference service's own config loader, the GPU request and placement."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from aiserve.common.config import load_config
from services.inference.config import InferenceConfig
from suite.crd_schema import SCHEMAS, errors, load_crd
from suite.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "cuda")
COMPONENTS = ("keda", "hpa")
KUBERNETES = "1.30"
CRDS = {"keda.sh/v1alpha1": SCHEMAS / "keda.sh_scaledobjects.yaml"}
GPU = "nvidia.com/gpu"


def _rendered(overlay: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(K8S / "overlays" / overlay)}


def _inference(overlay: str) -> dict:
    return _rendered(overlay)[("Deployment", "inference")]["spec"]["template"]["spec"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def cores(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "500m") in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def validate(doc: dict) -> None:
    """A built-in object against Kubernetes' schemas, a custom one against its vendored CRD."""
    if (crd := CRDS.get(doc["apiVersion"])) is not None:
        assert errors(doc, load_crd(crd)) == [], doc["metadata"]["name"]
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _with_component(tmp_path: Path, overlay: str, component: str) -> list[dict]:
    spec = {"resources": [str(K8S / "overlays" / overlay)], "components": [str(K8S / "components" / component)]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_every_overlay_with_either_autoscaler_renders_valid_objects(
    tmp_path: Path, overlay: str, component: str
) -> None:
    docs = _with_component(tmp_path, overlay, component)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Job", "PersistentVolumeClaim"} <= kinds
    assert {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}[component] in kinds
    for doc in docs:
        validate(doc)


def test_the_validation_rejects_a_misspelled_field_in_a_rendered_object() -> None:
    deployment = _rendered("cuda")[("Deployment", "inference")]
    deployment["spec"]["template"]["spec"]["nodeSelecter"] = {"x": "y"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_overlay_runs_an_unpinned_image(overlay: str) -> None:
    for (kind, name), doc in _rendered(overlay).items():
        pod = doc["spec"]["template"]["spec"] if "template" in doc.get("spec", {}) else None
        for container in (pod or {}).get("containers", []):
            assert re.fullmatch(r"[a-z0-9-]+:\d+\.\d+\.\d+", container["image"]), (kind, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_inference_settings_load_through_the_service_config(overlay: str) -> None:
    container = _inference(overlay)["containers"][0]
    env = _env(container)
    assert set(env) == {"AISERVE_INFERENCE_DEVICE", "AISERVE_INFERENCE_DTYPE", "AISERVE_INFERENCE_TORCH_THREADS"}
    config = load_config(InferenceConfig, "inference", argv=[], environ=env)  # validates, too
    assert (config.device, config.dtype) == ({"cpu": "cpu", "cuda": "cuda"}[overlay], "auto")
    # Torch does not read the CPU quota: its threads are the cores the pod asked for.
    assert config.torch_threads == cores(container["resources"]["requests"]["cpu"])


def test_the_cpu_overlay_asks_for_no_gpu() -> None:
    for name in ("tokenizer", "inference", "cache", "gateway"):
        pod = _rendered("cpu")[("Deployment", name)]["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod, name
        assert GPU not in pod["containers"][0]["resources"]["limits"], name
        assert pod["containers"][0]["image"] == "aiserve:0.1.0", name


def test_the_cuda_overlay_puts_inference_alone_on_one_gpu() -> None:
    pod = _inference("cuda")
    resources = pod["containers"][0]["resources"]
    assert resources["limits"][GPU] == resources["requests"][GPU] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["containers"][0]["image"] == "aiserve-cuda:0.1.0"
    for name in ("tokenizer", "cache", "gateway"):
        other = _rendered("cuda")[("Deployment", name)]["spec"]["template"]["spec"]
        assert GPU not in other["containers"][0]["resources"]["limits"], name
        assert "nodeSelector" not in other, name


def test_the_cuda_image_is_the_dockerfile_built_with_a_cuda_torch_channel() -> None:
    """The overlay names the image the containers doc says how to build; the Dockerfile takes the
    torch channel as a build argument whose default is the CPU build."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_CHANNEL=cpu$", dockerfile, flags=re.MULTILINE)
    assert "https://download.pytorch.org/whl/${TORCH_CHANNEL}" in dockerfile
    doc = (ROOT / "docs" / "containers.md").read_text()
    build = re.search(r"docker build --build-arg TORCH_CHANNEL=(cu\d+) -t (\S+) \.", doc)
    assert build and build.group(2) == _inference("cuda")["containers"][0]["image"]


def test_the_overlays_change_nothing_but_inference_and_image_tags() -> None:
    base = {(d["kind"], d["metadata"]["name"]): d for d in render(K8S / "base")}
    for overlay in OVERLAYS:
        rendered = _rendered(overlay)
        assert set(rendered) == set(base)
        for key, doc in rendered.items():
            if key != ("Deployment", "inference"):
                text = yaml.safe_dump(doc).replace("aiserve:0.1.0", "aiserve:latest")
                assert text == yaml.safe_dump(base[key]), (overlay, key)


def test_every_manifest_file_under_deploy_k8s_is_rendered_by_some_kustomization() -> None:
    """So that the validation above sees every file: none lies outside a kustomization."""
    listed = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", []) if "path" in p]:
            listed.add((kustomization.parent / entry).resolve())
    manifests = {p.resolve() for p in K8S.rglob("*.yaml")
                 if p.name != "kustomization.yaml" and SCHEMAS not in p.parents
                 and not p.name.startswith("prometheus-adapter")}
    assert manifests and manifests <= listed, sorted(map(str, manifests - listed))
