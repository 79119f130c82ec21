"""SuiteConfig's ports and a real service started the way the suite starts it: on port 0,
announcing the port it bound, restarted on the same port, and failing fast with its reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.store import ModelStore
from services.gateway.config import GatewayConfig
from services.tokenizer.config import TokenizerConfig
from suite.runner import SERVICE_CONFIGS, SERVICES, Suite, SuiteConfig

TIMEOUT_S = 120.0


def field_default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_default_ports_are_the_services_own_defaults(tmp_path: Path) -> None:
    config = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path)})
    assert config.ports == {name: field_default(SERVICE_CONFIGS[name], "port") for name in SERVICES}
    assert config.metrics_ports == {name: field_default(SERVICE_CONFIGS[name], "metrics_port") for name in SERVICES}
    assert config.ports["gateway"] == field_default(GatewayConfig, "port") == 50051
    assert config.ports["tokenizer"] == field_default(TokenizerConfig, "port") == 50052
    moved = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path), "AISERVE_GATEWAY_PORT": "50061",
                                  "AISERVE_CACHE_METRICS_PORT": "9114"})
    assert (moved.ports["gateway"], moved.metrics_ports["cache"]) == (50061, 9114)


def test_a_port_0_service_has_no_address_until_it_announces_one(tmp_path: Path) -> None:
    config = SuiteConfig.for_tests(tmp_path)
    assert set(config.ports.values()) == {0} and set(config.metrics_ports.values()) == {0}
    with pytest.raises(LookupError, match="tokenizer has not announced"):
        config.address("tokenizer")
    with pytest.raises(LookupError):
        config.env_for("gateway", {})  # the gateway needs its backends' real addresses
    for backend in ("tokenizer", "inference", "cache"):
        config.ports[backend] = 40000
    assert config.env_for("gateway", {})["AISERVE_GATEWAY_CACHE_ADDRESS"] == "127.0.0.1:40000"


@pytest.fixture
def tokenizer_suite(tmp_path: Path, store: ModelStore) -> Iterator[Suite]:
    config = SuiteConfig.for_tests(tmp_path / "home")
    config.extra_env["AISERVE_MODEL_STORE"] = str(store.root)
    suite = Suite(config)
    try:
        yield suite
    finally:
        suite.stop()


async def health(address: str) -> int:
    async with aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    return int(reply.status)


async def test_a_service_on_port_0_announces_its_port_and_keeps_it_on_restart(tokenizer_suite: Suite) -> None:
    suite = tokenizer_suite
    suite.start_service("tokenizer")
    await suite.wait_serving(("tokenizer",), timeout_s=TIMEOUT_S)
    port = suite.config.ports["tokenizer"]
    assert port > 0 and suite.config.address("tokenizer") == f"127.0.0.1:{port}"
    assert await health(suite.config.address("tokenizer")) == health_pb2.HealthCheckResponse.SERVING
    assert suite.stop_service("tokenizer") == 0
    suite.start_service("tokenizer")  # a restart binds the same port: the gateway's address stays right
    await suite.wait_serving(("tokenizer",), timeout_s=TIMEOUT_S)
    assert suite.config.ports["tokenizer"] == port
    assert await health(suite.config.address("tokenizer")) == health_pb2.HealthCheckResponse.SERVING


async def test_a_service_that_exits_before_it_binds_fails_fast_with_its_reason(tokenizer_suite: Suite,
                                                                              tmp_path: Path) -> None:
    suite = tokenizer_suite
    suite.config.extra_env["AISERVE_MODEL_STORE"] = str(tmp_path / "empty-store")
    suite.start_service("tokenizer")
    with pytest.raises(RuntimeError, match="tokenizer exited with code 2") as info:
        await suite.wait_serving(("tokenizer",), timeout_s=TIMEOUT_S)
    assert "not in the store" in str(info.value)
    assert suite.processes["tokenizer"].returncode == 2
