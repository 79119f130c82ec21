"""A small kustomize renderer for deploy/k8s, so that the overlays are rendered and checked where
neither the ``kustomize`` binary nor ``kubectl kustomize`` is installed (no network to fetch them).

It renders the subset of the Kustomization format that deploy/k8s uses and refuses everything
else, so that it never renders a file differently from kustomize without saying so:
``resources`` (files, and folders holding a kustomization), ``components``, ``labels`` (without
``includeSelectors``), ``patches`` written as JSON 6902 operations with a ``target``, and
``images``. Transformers run in kustomize's order: patches, then labels, then images.
tests/unit/test_kustomize.py compares its output with ``kubectl kustomize`` where that exists.

    python -m suite.kustomize deploy/k8s/overlays/cpu | kubectl apply -f -
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "components", "labels", "patches", "images"}
TARGET_FIELDS = {"group", "version", "kind", "name", "namespace"}
# Where pod specs sit in the workload kinds; images are set in their containers.
POD_SPEC_PATHS = (("spec", "template", "spec"), ("spec", "jobTemplate", "spec", "template", "spec"), ("spec",))


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render exactly, or one that is wrong."""


def render(folder: Path) -> list[Doc]:
    """Every resource the kustomization in ``folder`` produces, in the order they were listed."""
    spec = _read_kustomization(folder, expected_kind="Kustomization")
    docs = _load_resources(folder, spec)
    for component in spec.get("components", []):
        docs = _apply_component(folder / component, docs)
    return _transform(folder, spec, docs)


def _read_kustomization(folder: Path, expected_kind: str) -> Doc:
    path = next((folder / name for name in KUSTOMIZATION_FILES if (folder / name).is_file()), None)
    if path is None:
        raise KustomizeError(f"{folder}: no kustomization file")
    spec = yaml.safe_load(path.read_text()) or {}
    kind = spec.get("kind", "Kustomization")
    if kind != expected_kind:
        raise KustomizeError(f"{path}: kind {kind!r}, expected {expected_kind}")
    if unsupported := sorted(set(spec) - SUPPORTED_FIELDS):
        raise KustomizeError(f"{path}: fields this renderer does not implement: {', '.join(unsupported)}")
    return spec


def _load_resources(folder: Path, spec: Doc) -> list[Doc]:
    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _apply_component(folder: Path, docs: list[Doc]) -> list[Doc]:
    """A Component adds its resources to those gathered so far, then transforms them all."""
    spec = _read_kustomization(folder, expected_kind="Component")
    return _transform(folder, spec, docs + _load_resources(folder, spec))


def _transform(folder: Path, spec: Doc, docs: list[Doc]) -> list[Doc]:
    docs = copy.deepcopy(docs)
    for patch in spec.get("patches", []):
        _apply_patch(folder, patch, docs)
    for labels in spec.get("labels", []):
        _apply_labels(labels, docs)
    for image in spec.get("images", []):
        _apply_image(image, docs)
    return docs


def _apply_patch(folder: Path, patch: Doc, docs: list[Doc]) -> None:
    text = (folder / patch["path"]).read_text() if "path" in patch else patch.get("patch", "")
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise KustomizeError(f"{folder}: only JSON 6902 patches (a list of operations) are rendered here, "
                             "not strategic merge patches")
    target = patch.get("target")
    if not target:
        raise KustomizeError(f"{folder}: a JSON 6902 patch needs a target")
    if unknown := sorted(set(target) - TARGET_FIELDS):
        raise KustomizeError(f"{folder}: target fields not implemented: {', '.join(unknown)}")
    matched = [doc for doc in docs if _selects(target, doc)]
    if not matched:  # kustomize lets this pass; here it is a mistake worth stopping on
        raise KustomizeError(f"{folder}: patch target {target} matches no resource")
    for doc in matched:
        for operation in operations:
            apply_operation(doc, operation)


def _selects(target: Doc, doc: Doc) -> bool:
    group, _, version = doc.get("apiVersion", "").rpartition("/")
    found = {"group": group, "version": version, "kind": doc.get("kind", ""),
             "name": doc["metadata"].get("name", ""), "namespace": doc["metadata"].get("namespace", "")}
    # kustomize reads each target field as an anchored regular expression.
    return all(re.fullmatch(str(value), found[key]) for key, value in target.items())


def apply_operation(doc: Doc, operation: Doc) -> None:
    """One RFC 6902 operation (add, remove, replace, move, copy, test) applied to ``doc`` in place."""
    op, path = operation["op"], operation["path"]
    if op == "test":
        if (found := _get(doc, path)) != operation["value"]:
            raise KustomizeError(f"test {path}: expected {operation['value']!r}, found {found!r}")
    elif op == "add":
        _add(doc, path, copy.deepcopy(operation["value"]))
    elif op == "remove":
        _remove(doc, path)
    elif op == "replace":
        _remove(doc, path)
        _add(doc, path, copy.deepcopy(operation["value"]))
    elif op in ("move", "copy"):
        value = copy.deepcopy(_get(doc, operation["from"]))
        if op == "move":
            _remove(doc, operation["from"])
        _add(doc, path, value)
    else:
        raise KustomizeError(f"unknown JSON patch operation {op!r}")


def _tokens(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]]


def _step(node: Any, token: str, path: str) -> Any:
    try:
        return node[int(token)] if isinstance(node, list) else node[token]
    except (KeyError, IndexError, ValueError, TypeError):
        raise KustomizeError(f"JSON pointer {path!r}: no {token!r}") from None


def _get(doc: Doc, path: str) -> Any:
    node: Any = doc
    for token in _tokens(path):
        node = _step(node, token, path)
    return node


def _parent(doc: Doc, path: str) -> tuple[Any, str]:
    *head, last = _tokens(path)
    node: Any = doc
    for token in head:
        node = _step(node, token, path)
    return node, last


def _add(doc: Doc, path: str, value: Any) -> None:
    parent, last = _parent(doc, path)
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise KustomizeError(f"JSON pointer {path!r}: index out of range")
        parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KustomizeError(f"JSON pointer {path!r}: parent is not a container")


def _remove(doc: Doc, path: str) -> None:
    parent, last = _parent(doc, path)
    _step(parent, last, path)  # raises if absent: remove and replace need the value to exist
    del parent[int(last) if isinstance(parent, list) else last]


def _apply_labels(labels: Doc, docs: list[Doc]) -> None:
    if labels.get("includeSelectors"):
        raise KustomizeError("labels with includeSelectors are not implemented here")
    for doc in docs:
        doc["metadata"].setdefault("labels", {}).update(labels["pairs"])
        template = doc.get("spec", {}).get("template") if labels.get("includeTemplates") else None
        if isinstance(template, dict):
            template.setdefault("metadata", {}).setdefault("labels", {}).update(labels["pairs"])


def split_image(image: str) -> tuple[str, str]:
    """("registry:5000/aiserve", ":0.1.0") for "registry:5000/aiserve:0.1.0"; the suffix keeps its
    separator (":tag", "@sha256:...", or "" for neither)."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    return (image[:colon], image[colon:]) if colon > slash else (image, "")


def _apply_image(rule: Doc, docs: list[Doc]) -> None:
    for doc in docs:
        for container in _containers(doc):
            name, suffix = split_image(container["image"])
            if name != rule["name"]:
                continue
            if "digest" in rule:
                suffix = "@" + rule["digest"]
            elif "newTag" in rule:
                suffix = ":" + str(rule["newTag"])
            container["image"] = rule.get("newName", name) + suffix


def _containers(doc: Doc) -> list[Doc]:
    for path in POD_SPEC_PATHS:
        node: Any = doc
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and "containers" in node:
            return [*node["containers"], *node.get("initContainers", [])]
    return []


def main(argv: list[str] | None = None) -> int:
    """Print the rendered kustomization of the folder given as the one argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m suite.kustomize FOLDER", file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(render(Path(args[0])), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
