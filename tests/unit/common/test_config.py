"""Settings loading (defaults, TOML, environment, flags) and ``ServiceConfig.validate()``."""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiserve.common.config import ConfigError, ServiceConfig, config_with, load_config, settings_of


@dataclass(frozen=True)
class DemoConfig(ServiceConfig):
    port: int = 1000
    name: str = "a"
    ratio: float = 0.5
    enabled: bool = False


def test_defaults() -> None:
    assert load_config(DemoConfig, "demo", [], {}) == DemoConfig()


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[demo]\nport = 2000\nname = "toml"\nratio = 0.25\n')
    env = {"AISERVE_DEMO_NAME": "env", "AISERVE_DEMO_ENABLED": "true", "AISERVE_OTHER_PORT": "9"}
    config = load_config(DemoConfig, "demo", ["--config", str(toml), "--ratio", "0.75"], env)
    assert config == DemoConfig(port=2000, name="env", ratio=0.75, enabled=True)


def test_env_config_file_is_used(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text("port = 3000\n")
    assert load_config(DemoConfig, "demo", [], {"AISERVE_CONFIG": str(toml)}).port == 3000


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text("[demo]\nprot = 1\n")
    with pytest.raises(ConfigError, match="demo.prot"):
        load_config(DemoConfig, "demo", ["--config", str(toml)], {})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"AISERVE_DEMO_PORT": "70000"}, "port: must be 0..65535"),
        ({"AISERVE_DEMO_PORT": "x"}, "port: expected int"),
        ({"AISERVE_DEMO_ENABLED": "maybe"}, "enabled: expected a boolean"),
        ({"AISERVE_DEMO_LOG_LEVEL": "loud"}, "log_level"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(DemoConfig, "demo", [], env)


SERVICE_BAD_VALUES: dict[str, tuple[object, str]] = {
    "host": ("", "host: must not be empty"),
    "port": (-1, "port: must be 0..65535"),
    "metrics_port": (65536, "metrics_port: must be 0..65535"),
    "log_level": ("loud", "log_level: must be debug|info|warning|error"),
    "grace_s": (601.0, "grace_s: must be 0..600"),
    "announce_fd": (-2, "announce_fd: must be a file descriptor or -1"),
}
"""One bad value of each setting every service has, and the message that names it."""


@pytest.mark.parametrize("name", sorted(SERVICE_BAD_VALUES))
def test_service_config_validate_refuses_one_bad_value_of_each_setting(name: str) -> None:
    value, message = SERVICE_BAD_VALUES[name]
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_with(ServiceConfig, **{name: value})


def test_every_service_setting_is_validated() -> None:
    assert set(settings_of(ServiceConfig)) == set(SERVICE_BAD_VALUES)
    assert config_with(ServiceConfig, announce_fd=-1, port=0) == ServiceConfig()  # the defaults pass
