"""TokenizerConfig: defaults, settings sources, and a ``validate()`` that names the field and the limit."""

from __future__ import annotations

import re

import pytest

from aiserve.common.config import ConfigError, config_with, load_config, settings_of
from services.tokenizer.config import TokenizerConfig
from tests.unit.common.test_config import SERVICE_BAD_VALUES


def test_defaults() -> None:
    config = load_config(TokenizerConfig, "tokenizer", [], environ={})
    assert (config.port, config.metrics_port) == (50052, 9102)
    assert config.model == "smollm2-135m-instruct@0.1.2"
    assert config.model_store == ""  # resolved when the server is created


def test_environment_then_flags() -> None:
    environ = {"AISERVE_TOKENIZER_PORT": "50062", "AISERVE_TOKENIZER_MODEL_STORE": "/m"}
    config = load_config(TokenizerConfig, "tokenizer", ["--port", "0"], environ=environ)
    assert (config.port, config.model_store) == (0, "/m")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "smollm2"], "model: must be 'name@version'"),
        (["--port", "70000"], "port: must be 0..65535"),
        (["--grace-s", "-1"], "grace_s: must be 0..600"),
    ],
)
def test_validation_names_the_field(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TokenizerConfig, "tokenizer", argv, environ={})


BAD_VALUES: dict[str, tuple[object, str]] = {
    **SERVICE_BAD_VALUES,  # the settings every service has
    "model": ("smollm2@", "model: must be 'name@version'"),
}
FREE_FORM = {"model_store"}
"""Settings any value of which is valid ("" = the default store, else a folder checked on load)."""


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_validate_refuses_one_bad_value_of_each_setting(name: str) -> None:
    value, message = BAD_VALUES[name]
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_with(TokenizerConfig, **{name: value})


def test_every_setting_is_validated_or_free_form() -> None:
    assert set(settings_of(TokenizerConfig)) == set(BAD_VALUES) | FREE_FORM
    config_with(TokenizerConfig)  # the defaults pass
