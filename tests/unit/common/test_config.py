from dataclasses import dataclass
from pathlib import Path

import pytest

from aiserve.common.config import ConfigError, ServiceConfig, load_config


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
