"""TokenizerConfig: DESIGN.md defaults, settings sources, validation naming field and limit."""

from __future__ import annotations

import pytest

from aiserve.common.config import ConfigError, load_config
from services.tokenizer.config import TokenizerConfig


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
