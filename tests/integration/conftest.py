"""The four real services on free ports, with the real model, for the integration tests."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiserve.store import ModelStore
from aiserve.suite import Suite, SuiteConfig


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    config = SuiteConfig.for_tests(tmp_path_factory.mktemp("aiserve-home"))
    config.extra_env["AISERVE_MODEL_STORE"] = str(store.root)
    # float32: greedy answers are then reproducible across batch compositions (source §7.2).
    config.extra_env["AISERVE_INFERENCE_DTYPE"] = "float32"
    suite = Suite(config)
    try:
        asyncio.run(suite.start(timeout_s=300))
        yield suite
    finally:
        suite.stop()


def new_request_id() -> str:
    return f"it-{uuid.uuid4().hex[:16]}"


def log_records(suite: Suite, service: str) -> list[dict[str, object]]:
    """The JSON lines a service has logged so far (every line must be JSON)."""
    path: Path = suite.log_path(service)
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records
