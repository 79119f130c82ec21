"""SuiteConfig with inference replicas: instance names, ports, threads, environments and the
gateway's target (decision 46). With one replica everything is as before replicas existed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from suite.config import SuiteConfig, service_of


def test_one_replica_is_named_inference_on_the_default_ports(tmp_path: Path) -> None:
    config = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path)})
    assert config.inference_replicas == 1
    assert config.inference_names == ("inference",)
    assert config.instance_names == ("tokenizer", "inference", "cache", "gateway")
    assert (config.ports["inference"], config.metrics_ports["inference"]) == (50053, 9103)
    env = config.env_for("gateway", {})
    assert env["AISERVE_GATEWAY_INFERENCE_ADDRESS"] == "127.0.0.1:50053"
    assert env["AISERVE_GATEWAY_ADMIN_KEY_PATH"] == str(tmp_path.resolve() / "admin.key")
    assert config.env_for("inference", {})["AISERVE_INFERENCE_TORCH_THREADS"] == str(os.cpu_count() or 1)


def test_replicas_get_their_own_names_and_ports_base_plus_ten(tmp_path: Path) -> None:
    config = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path), "AISERVE_INFERENCE_REPLICAS": "3"})
    assert config.inference_names == ("inference-0", "inference-1", "inference-2")
    assert config.instance_names == ("tokenizer", "inference-0", "inference-1", "inference-2", "cache", "gateway")
    assert "inference" not in config.ports and "inference" not in config.metrics_ports
    assert [config.ports[n] for n in config.inference_names] == [50053, 50063, 50073]
    assert [config.metrics_ports[n] for n in config.inference_names] == [9103, 9113, 9123]
    assert [config.address(n) for n in config.inference_names] == [
        "127.0.0.1:50053", "127.0.0.1:50063", "127.0.0.1:50073"]
    env = config.env_for("inference-1", {})
    assert (env["AISERVE_INFERENCE_PORT"], env["AISERVE_INFERENCE_METRICS_PORT"]) == ("50063", "9113")
    gateway = config.env_for("gateway", {})
    assert gateway["AISERVE_GATEWAY_INFERENCE_ADDRESS"] == "ipv4:127.0.0.1:50053,127.0.0.1:50063,127.0.0.1:50073"
    assert gateway["AISERVE_GATEWAY_TOKENIZER_ADDRESS"] == "127.0.0.1:50052"


def test_a_flag_wins_over_the_variable_and_a_moved_port_moves_every_replica(tmp_path: Path) -> None:
    environ = {"AISERVE_HOME": str(tmp_path), "AISERVE_INFERENCE_REPLICAS": "3", "AISERVE_INFERENCE_PORT": "60053"}
    config = SuiteConfig.from_env(environ, inference_replicas=2)
    assert {n: config.ports[n] for n in config.inference_names} == {"inference-0": 60053, "inference-1": 60063}


def test_port_0_replicas_each_announce_their_own(tmp_path: Path) -> None:
    config = SuiteConfig.for_tests(tmp_path, inference_replicas=2)
    assert config.ports == {"tokenizer": 0, "inference-0": 0, "inference-1": 0, "cache": 0, "gateway": 0}
    assert config.env_for("inference-1", {})["AISERVE_INFERENCE_PORT"] == "0"
    config.ports["tokenizer"] = 40001
    with pytest.raises(LookupError, match="inference-0 has not announced"):
        config.env_for("gateway", {})
    config.ports.update({"inference-0": 40002, "inference-1": 40003, "cache": 40004})
    assert config.env_for("gateway", {})["AISERVE_GATEWAY_INFERENCE_ADDRESS"] == "ipv4:127.0.0.1:40002,127.0.0.1:40003"


@pytest.mark.parametrize(("replicas", "cores", "threads"), [(1, 8, 8), (2, 8, 4), (3, 8, 2), (4, 2, 1), (1, 1, 1)])
def test_the_cores_are_split_between_the_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  replicas: int, cores: int, threads: int) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    config = SuiteConfig.for_tests(tmp_path, inference_replicas=replicas)
    for name in config.inference_names:
        assert config.env_for(name, {})["AISERVE_INFERENCE_TORCH_THREADS"] == str(threads)
    config.inference_threads = 3  # set explicitly: every replica gets that many
    assert config.env_for(config.inference_names[-1], {})["AISERVE_INFERENCE_TORCH_THREADS"] == "3"
    assert config.env_for("tokenizer", {})["OMP_NUM_THREADS"] == "1"


def test_instance_env_reaches_one_instance_only(tmp_path: Path) -> None:
    config = SuiteConfig.for_tests(tmp_path, inference_replicas=2)
    config.extra_env["AISERVE_INFERENCE_DTYPE"] = "float32"
    config.instance_env["inference-1"] = {"AISERVE_INFERENCE_FAULT_FILE": "/tmp/fault",
                                          "AISERVE_INFERENCE_DTYPE": "bf16"}
    zero, one = config.env_for("inference-0", {}), config.env_for("inference-1", {})
    assert "AISERVE_INFERENCE_FAULT_FILE" not in zero and zero["AISERVE_INFERENCE_DTYPE"] == "float32"
    assert one["AISERVE_INFERENCE_FAULT_FILE"] == "/tmp/fault" and one["AISERVE_INFERENCE_DTYPE"] == "bf16"


def test_instance_names_map_to_their_service() -> None:
    assert [service_of(n) for n in ("inference-0", "inference-12", "inference", "gateway")] == [
        "inference", "inference", "inference", "gateway"]


@pytest.mark.parametrize("replicas", ["0", "-1", "two"])
def test_a_bad_replica_count_is_refused(tmp_path: Path, replicas: str) -> None:
    with pytest.raises(ValueError):
        SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path), "AISERVE_INFERENCE_REPLICAS": replicas})


def test_the_gateway_http_port_is_a_setting_of_the_suite(tmp_path: Path) -> None:
    default = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path)})
    assert default.http_port == 8000 and default.http_address() == "http://127.0.0.1:8000"
    assert default.env_for("gateway", {})["AISERVE_GATEWAY_HTTP_PORT"] == "8000"
    assert "AISERVE_GATEWAY_HTTP_PORT" not in default.env_for("tokenizer", {})
    off = SuiteConfig.from_env({"AISERVE_HOME": str(tmp_path), "AISERVE_GATEWAY_HTTP_PORT": "0"})
    assert off.http_address() == ""
    tests = SuiteConfig.for_tests(tmp_path)
    assert tests.http_port == -1  # a free port, which the gateway announces
    with pytest.raises(LookupError):
        tests.http_address()  # until the gateway announces the port it bound
