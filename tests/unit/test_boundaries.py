"""The core modules stay free of the edges: importing them (in a fresh interpreter, so nothing
else has loaded them first) loads neither grpc nor torch, and the scheduler and the gateway's
pipeline load no generated protobuf module either (pb and grpc live in the servicers and the
client adapters only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0
EDGES = ("grpc", "torch")
PB = ("aiserve.v1",)
GATEWAY_CORE = tuple(f"services.gateway.{name}" for name in (
    "accounting", "cache_keys", "cache_lookup", "canary_judge", "changes", "config", "domain", "feedback",
    "interfaces", "judge_config", "ledger", "limits", "metrics", "pipeline", "pricing", "replicas", "route_store",
    "route_table", "stops", "targets", "tenants", "validation", "version_window"))
"""The gateway's modules without grpc or pb (docs/gateway.md, "Core and edge")."""
HEAVY = ("torch", "transformers", "sentence_transformers", "sklearn", "scipy")
"""What a service that does not run a model must not import: each costs CPU seconds at start,
while the inference service loads its model beside it (README, "Cold start")."""

_PROBE = """
import importlib, json, sys
for name in sys.argv[1].split(","):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(modules: tuple[str, ...]) -> set[str]:
    """Every module in ``sys.modules`` after importing ``modules`` in a new interpreter."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(modules)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def offenders(loaded: set[str], forbidden: tuple[str, ...]) -> list[str]:
    """The loaded modules that are, or are inside, a forbidden package."""
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize(("modules", "forbidden"), [
    (("services.inference.scheduler",), EDGES + PB),
    (("services.cache.semantic", "services.cache.guard"), EDGES),
    (("services.gateway.pipeline",), EDGES + PB),
    (GATEWAY_CORE, EDGES + PB),
    (("services.gateway.server", "services.tokenizer.server"), HEAVY),
], ids=["inference-scheduler", "cache-matching", "gateway-pipeline", "gateway-core", "no-model-servers"])
def test_core_modules_import_no_edge(modules: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    loaded = loaded_by(modules)
    assert set(modules) <= loaded  # the probe did import them
    assert offenders(loaded, forbidden) == []


def test_the_probe_sees_an_edge_module() -> None:
    """The check is not hollow: a module that does use grpc and pb is caught."""
    loaded = loaded_by(("services.gateway.server",))
    assert "grpc" in offenders(loaded, EDGES)
    assert "aiserve.v1.gateway_pb2" in offenders(loaded, PB)
