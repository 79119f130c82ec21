"""The four real services on ports they bind themselves, with the real model, for the integration tests."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aiserve.common.paths import KEYS_FILE, LEDGER_FILE
from aiserve.store import ModelStore
from services.gateway.ledger import LedgerReader, UsageRow
from services.gateway.tenants import KeyStore, Tenant
from suite.runner import Suite, SuiteConfig


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    config = suite_config(tmp_path_factory.mktemp("aiserve-home"), store)
    config.extra_env["AISERVE_INFERENCE_MAX_NUM_SEQS"] = str(SUITE_MAX_NUM_SEQS)
    yield from run_suite(config)


SUITE_MAX_NUM_SEQS = 32
"""The suite's batch: 32 float32 slots of 2048 tokens (the KV cache is sized from them: ~2.96 GiB)."""


@pytest.fixture(scope="module")
def small_batch_suite(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    """A second suite whose engine runs at most 2 sequences at once, so a queue forms (priority)."""
    config = suite_config(tmp_path_factory.mktemp("aiserve-small"), store)
    config.extra_env["AISERVE_INFERENCE_MAX_NUM_SEQS"] = "2"  # the KV cache is sized from it: ~200 MB
    yield from run_suite(config)


TEST_TORCH_THREADS = 1
"""torch threads of the test suites' inference service. The tests share the machine's cores
with four services, pytest and whatever else runs there; a team of OpenMP threads as wide as
the cores then spins at each parallel region's barrier for a partner the kernel has not
scheduled. On the 2-core VM with two busy processes beside it, a 2-sequence decode step of
the small-batch suite took 0.9-1.7 s on 2 threads and 0.1 s on one, so a test of ~75 steps
overran its 120 s deadline (docs/decisions.md, decision 48)."""


def config_for_tests(home: Path, store_root: Path, inference_replicas: int = 1) -> SuiteConfig:
    """Settings of a suite a test starts: free ports, the model store at ``store_root``,
    TEST_TORCH_THREADS per inference instance."""
    config = SuiteConfig.for_tests(home, inference_replicas=inference_replicas)
    config.extra_env["AISERVE_MODEL_STORE"] = str(store_root)
    # In extra_env, not inference_threads: it must win over the caller's environment too.
    config.extra_env["AISERVE_INFERENCE_TORCH_THREADS"] = str(TEST_TORCH_THREADS)
    return config


def suite_config(home: Path, store: ModelStore) -> SuiteConfig:
    """A shared test suite's settings: ``config_for_tests`` over the test model store, float32."""
    config = config_for_tests(home, store.root)
    # float32: greedy answers are then reproducible across batch compositions (docs/engine.md).
    config.extra_env["AISERVE_INFERENCE_DTYPE"] = "float32"
    return config


def run_suite(config: SuiteConfig) -> Iterator[Suite]:
    """A module fixture's body: the suite started (SERVING), yielded, stopped at the end."""
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


def dev_key(suite: Suite) -> str:
    """The development tenant's key that starting the suite wrote to $AISERVE_HOME/dev.key."""
    return suite.dev_key_path.read_text().strip()


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def create_tenant(home: Path, prefix: str, tier: str = "free", **limits: int) -> tuple[str, str]:
    """A new tenant (unique name) with one key, in a suite's key store: (tenant, key).

    The gateway reads the store on every call, so a key works as soon as this returns."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    store = KeyStore(home / KEYS_FILE)
    try:
        store.put_tenant(Tenant(name, tier, **limits))  # type: ignore[arg-type]
        return name, store.create_key(name)[1]
    finally:
        store.close()


def ledger_rows(home: Path, tenant: str | None = None) -> list[UsageRow]:
    """The committed usage rows, read straight from the suite's SQLite ledger (read-only)."""
    return LedgerReader(home / LEDGER_FILE).rows(tenant)


async def eventually(condition: Callable[[], bool], timeout_s: float = 30, what: str = "condition") -> None:
    """Wait until ``condition()`` holds, checking every 50 ms up to ``timeout_s``.

    Only for what no event announces to the test: how a server process reacts to a client that
    cancelled or whose deadline passed (the client has gone, so no answer can carry it; the log
    line of the ended call and its ledger row appear some time later). Where an answer can carry
    the effect, wait for that answer instead (e.g. ``rows_committed`` in test_tenants.py)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:.0f}s")
        await asyncio.sleep(0.05)
