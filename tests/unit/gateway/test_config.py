"""GatewayConfig.validate(): the defaults pass, and one bad value of each setting group is
refused with a ConfigError that names the setting, whichever way the setting arrives."""

from __future__ import annotations

from typing import Any

import pytest

from aiserve.common.config import ConfigError, config_with, load_config
from services.gateway.config import GatewayConfig

BAD_VALUES: list[tuple[str, Any]] = [
    # addresses and routing
    ("tokenizer_address", "nonsense"),
    ("inference_address", "localhost"),
    ("cache_address", "cache-without-port"),
    ("default_model", "no-version"),
    ("fingerprint_ttl_s", -1.0),
    ("downstream_timeout_s", 0.0),
    # request limits
    ("max_new_tokens_limit", 0),
    ("default_max_new_tokens", 4096),  # over max_new_tokens_limit (2048)
    ("max_prompt_tokens", 0),
    ("max_prompt_chars", 0),
    ("max_chat_messages", 0),
    ("max_stop_strings", -1),
    ("max_stop_chars", 0),
    ("cache_max_temperature", 2.5),
    ("cache_exact_wait_ms", -1.0),
    ("cache_exact_wait_ms", 1500.0),
    # prices
    ("prices", ("smollm2-135m-instruct@0.1.2=50/150",)),
    ("prompt_price_micros_per_token", -1),
    ("completion_price_micros_per_token", -1),
    ("compute_price_micros_per_second", -1),
    ("max_compute_ms_per_token", 60_001),
    # tiers
    ("free_priority", 1 << 31),
    ("free_requests_per_minute", 0),
    ("paid_tokens_per_minute", 0),
    ("paid_budget_micros", -1),
    # budget period
    ("budget_period", "week"),
    # repeat detection
    ("repeat_window_s", 0.0),
    ("repeat_similarity", 1.5),
    # feedback
    ("max_feedback_comment_chars", -1),
    # model routes
    ("route_stickiness", "user"),
    ("retire_after_s", -1.0),
    ("retire_after_s", 8 * 86_400.0),
    # every service's own settings
    ("port", 70_000),
]


def test_the_defaults_are_valid() -> None:
    GatewayConfig().validate()
    config_with(GatewayConfig, cache_address="")  # no cache is a valid choice
    for stickiness in ("none", "tenant", "session"):
        config_with(GatewayConfig, route_stickiness=stickiness)
    config_with(GatewayConfig, retire_after_s=0.0)  # a promote drops the former stable version at once


@pytest.mark.parametrize(("setting", "value"), BAD_VALUES, ids=[f"{name}={value}" for name, value in BAD_VALUES])
def test_a_bad_value_is_refused_naming_its_setting(setting: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        config_with(GatewayConfig, **{setting: value})
    assert str(info.value).startswith(f"{setting}: ")


def test_a_bad_address_from_the_environment_is_refused() -> None:
    """The check runs on the settings as loaded, not only on those built in code."""
    with pytest.raises(ConfigError, match="tokenizer_address: must be host:port, got 'nonsense'"):
        load_config(GatewayConfig, "gateway", [], {"AISERVE_GATEWAY_TOKENIZER_ADDRESS": "nonsense"})
    config = load_config(GatewayConfig, "gateway", [], {"AISERVE_GATEWAY_TOKENIZER_ADDRESS": "tok:1"})
    assert config.tokenizer_address == "tok:1"
