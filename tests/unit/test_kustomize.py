"""suite/kustomize.py renders deploy/k8s as kustomize does, and refuses what it does not implement.

The comparison with the real kustomize runs where ``kubectl`` (which embeds it) or ``kustomize``
is installed; the other tests hold the renderer's rules on their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from suite.kustomize import KustomizeError, apply_operation, main, render, split_image

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
FOLDERS = ("base", "overlays/cpu", "overlays/cuda")


def _by_id(docs: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(d["apiVersion"], d["kind"], d["metadata"]["name"]): d for d in docs}


def _real_kustomize(folder: Path) -> list[dict] | None:
    """The real kustomize's rendering of ``folder``, or None where neither binary is installed."""
    if kubectl := shutil.which("kubectl"):
        command = [kubectl, "kustomize", str(folder)]
    elif kustomize := shutil.which("kustomize"):
        command = [kustomize, "build", str(folder)]
    else:
        return None
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _overlay_with_component(tmp_path: Path, overlay: str, component: str) -> Path:
    """A kustomization in ``tmp_path`` that adds a component to an overlay, as a user would write
    it (kustomize wants the paths relative)."""
    spec = {"resources": [os.path.relpath(K8S / overlay, tmp_path)],
            "components": [os.path.relpath(K8S / "components" / component, tmp_path)]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


@pytest.mark.parametrize(("folder", "component"), [
    *((folder, None) for folder in FOLDERS),
    *((f"overlays/{o}", c) for o in ("cpu", "cuda") for c in ("keda", "hpa")),
])
def test_the_renderer_agrees_with_kustomize(tmp_path: Path, folder: str, component: str | None) -> None:
    path = K8S / folder if component is None else _overlay_with_component(tmp_path, folder, component)
    real = _real_kustomize(path)
    if real is None:
        pytest.skip("neither kubectl nor kustomize is installed; the other tests check the renderer")
    ours = render(path)
    assert len(ours) == len(real)  # kustomize reorders by kind; compare resource by resource
    assert _by_id(ours) == _by_id(real)


def _kustomization(tmp_path: Path, spec: dict, resources: list[dict]) -> Path:
    (tmp_path / "res.yaml").write_text(yaml.safe_dump_all(resources))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["res.yaml"], **spec}))
    return tmp_path


def _deployment(name: str, image: str) -> dict:
    pod = {"containers": [{"name": name, "image": image}]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"template": {"metadata": {"labels": {"app": name}}, "spec": pod}}}


def test_patches_labels_and_images_apply_to_their_targets_only(tmp_path: Path) -> None:
    add_env = "- {op: add, path: /spec/template/spec/containers/0/env, value: [{name: X, value: '1'}]}"
    spec = {
        "patches": [{"target": {"kind": "Deployment", "name": "a"}, "patch": add_env}],
        "labels": [{"pairs": {"team": "t"}}],
        "images": [{"name": "registry:5000/img", "newTag": "2"}],
    }
    docs = _by_id(render(_kustomization(tmp_path, spec, [_deployment("a", "registry:5000/img:1"),
                                                          _deployment("b", "other:1")])))
    a, b = docs[("apps/v1", "Deployment", "a")], docs[("apps/v1", "Deployment", "b")]
    assert a["spec"]["template"]["spec"]["containers"][0] == {
        "name": "a", "image": "registry:5000/img:2", "env": [{"name": "X", "value": "1"}]}
    assert "env" not in b["spec"]["template"]["spec"]["containers"][0]
    assert b["spec"]["template"]["spec"]["containers"][0]["image"] == "other:1"
    assert a["metadata"]["labels"] == b["metadata"]["labels"] == {"team": "t"}
    assert a["spec"]["template"]["metadata"]["labels"] == {"app": "a"}  # includeTemplates is off


@pytest.mark.parametrize(("spec", "message"), [
    ({"namespace": "x"}, "does not implement: namespace"),
    ({"patches": [{"target": {"kind": "Deployment"}, "patch": "spec: {replicas: 2}"}]}, "not strategic merge"),
    ({"patches": [{"patch": "- {op: remove, path: /spec}"}]}, "needs a target"),
    ({"patches": [{"target": {"kind": "Service"}, "patch": "- {op: remove, path: /spec}"}]}, "matches no resource"),
    ({"patches": [{"target": {"kind": "Deployment"}, "patch": "- {op: test, path: /metadata/name, value: b}"}]},
     "expected 'b'"),
    ({"labels": [{"pairs": {"x": "y"}, "includeSelectors": True}]}, "includeSelectors"),
])
def test_what_it_cannot_render_exactly_is_refused(tmp_path: Path, spec: dict, message: str) -> None:
    with pytest.raises(KustomizeError, match=message):
        render(_kustomization(tmp_path, spec, [_deployment("a", "img:1")]))


def test_json_patch_operations_follow_rfc_6902() -> None:
    doc = {"a": {"b/c": [1, 2], "d~e": 0}}
    apply_operation(doc, {"op": "add", "path": "/a/b~1c/-", "value": 3})
    apply_operation(doc, {"op": "add", "path": "/a/b~1c/0", "value": 0})
    apply_operation(doc, {"op": "replace", "path": "/a/d~0e", "value": 9})
    apply_operation(doc, {"op": "copy", "from": "/a/d~0e", "path": "/f"})
    apply_operation(doc, {"op": "move", "from": "/f", "path": "/g"})
    apply_operation(doc, {"op": "remove", "path": "/a/b~1c/1"})
    assert doc == {"a": {"b/c": [0, 2, 3], "d~e": 9}, "g": 9}
    with pytest.raises(KustomizeError, match="no 'missing'"):
        apply_operation(doc, {"op": "replace", "path": "/missing", "value": 1})
    with pytest.raises(KustomizeError, match="index out of range"):
        apply_operation(doc, {"op": "add", "path": "/a/b~1c/9", "value": 1})


@pytest.mark.parametrize(("image", "parts"), [
    ("aiserve", ("aiserve", "")),
    ("aiserve:0.1.0", ("aiserve", ":0.1.0")),
    ("registry:5000/team/aiserve", ("registry:5000/team/aiserve", "")),
    ("registry:5000/aiserve:0.1.0", ("registry:5000/aiserve", ":0.1.0")),
    ("aiserve@sha256:ab", ("aiserve", "@sha256:ab")),
])
def test_image_names_split_from_tags_and_digests(image: str, parts: tuple[str, str]) -> None:
    assert split_image(image) == parts


def test_the_command_prints_the_rendering(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(K8S / "overlays" / "cpu")]) == 0
    printed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert printed == render(K8S / "overlays" / "cpu")
    assert main([]) == 2
