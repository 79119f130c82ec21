"""Validate a custom resource (the KEDA ScaledObject) against its CustomResourceDefinition's
openAPIV3Schema with ``jsonschema``, the way ``kubectl apply`` with strict field validation does.

A CRD schema is structural: the API server prunes a field the schema does not name, and strict
field validation (kubectl's default since 1.27) rejects it. JSON Schema allows unknown fields
unless told otherwise, so every object schema that lists ``properties`` gets
``additionalProperties: false`` here, except where the CRD keeps unknown fields
(``x-kubernetes-preserve-unknown-fields``). ``x-kubernetes-int-or-string`` and ``nullable`` become
their JSON Schema forms. CEL rules (``x-kubernetes-validations``) are not evaluated: ``cel_rules``
lists them, so that a test can check each by hand and notice a new one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

Schema = dict[str, Any]
SCHEMAS = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "schemas"


def load_crd(path: Path) -> Schema:
    """The CustomResourceDefinition in ``path`` (the file's one YAML document)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if len(docs) != 1 or docs[0].get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path}: expected one CustomResourceDefinition")
    return docs[0]


def _version(crd: Schema, version: str) -> Schema:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry
    raise ValueError(f"{crd['metadata']['name']}: no version {version!r}")


def strict(node: Schema) -> Schema:
    """A copy of an OpenAPI v3 (structural) schema as a JSON Schema that rejects unknown fields."""
    out = dict(node)
    if "properties" in out:  # a map of field name -> schema, not a schema itself
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    if out.pop("x-kubernetes-int-or-string", False):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def json_schema(crd: Schema, version: str) -> Schema:
    """The JSON Schema of ``version`` of the CRD's kind, apiVersion and kind pinned to it."""
    schema = strict(_version(crd, version)["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def cel_rules(crd: Schema, version: str) -> list[str]:
    """Every CEL rule (``x-kubernetes-validations``) of the version's schema, in document order."""
    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                yield rule["rule"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
    return list(walk(_version(crd, version)["schema"]["openAPIV3Schema"]))


def errors(doc: Schema, crd: Schema) -> list[str]:
    """``path: message`` for each way ``doc`` breaks the CRD's schema; [] when it is valid."""
    version = doc.get("apiVersion", "").rpartition("/")[2]
    validator = jsonschema.Draft7Validator(json_schema(crd, version))
    return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(doc)]
