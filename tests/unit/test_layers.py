"""The layers point one way: ``suite`` (top) -> ``services`` -> ``aiserve`` (bottom).

Imports are read with ``ast`` from the source files, so a lazy import inside a function counts
as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "aiserve": ("services", "suite"),
    "services": ("suite",),
}
"""Packages each layer must not import: the ones above it."""


def imported_packages(source: str) -> set[str]:
    """Top-level package of every absolute import in ``source``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def layer_violations(layer: str) -> list[str]:
    """``path: package`` for each import in ``layer`` of a package above it."""
    violations = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        upward = imported_packages(path.read_text()) & set(FORBIDDEN[layer])
        violations += [f"{path.relative_to(ROOT)}: {package}" for package in sorted(upward)]
    return violations


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_a_layer_above_it(layer: str) -> None:
    assert layer_violations(layer) == []


def test_the_import_reader_sees_every_kind_of_import() -> None:
    source = (
        "import suite.cli\n"
        "from services.gateway import ledger\n"
        "from . import sibling\n"
        "def lazy() -> None:\n"
        "    import services.tokenizer.server as server\n"
    )
    assert imported_packages(source) == {"suite", "services"}
