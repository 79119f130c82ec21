from __future__ import annotations

import pytest

from aiserve.common.config import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.pricing import Price, PriceTable, parse_prices


def test_the_embedded_model_has_a_non_zero_price_by_default() -> None:
    table = GatewayConfig().price_table()
    price = table.price("smollm2-135m-instruct@0.1.2")
    assert price.prompt_per_token > 0 and price.completion_per_token > 0 and price.compute_per_second > 0
    assert table.cost("smollm2-135m-instruct@0.1.2", 10, 5, 0) > 0


def test_parse_prices_names_a_bad_entry() -> None:
    assert parse_prices(["a@1=1/2/3"]) == {"a@1": Price(1, 2, 3)}
    with pytest.raises(ConfigError) as info:
        parse_prices(["a@1=1/2"])
    assert "prices" in str(info.value) and "a@1=1/2" in str(info.value)


def test_cost_is_tokens_plus_capped_compute_and_never_above_max_cost() -> None:
    table = PriceTable({"m@1": Price(10, 30, 1000)}, Price(1, 1, 1), max_compute_ms_per_token=100)
    assert table.cost("m@1", 4, 2, compute_ms=250) == 4 * 10 + 2 * 30 + 250
    assert table.cost("m@1", 4, 2, compute_ms=10_000) == 40 + 60 + 600  # capped at 6 tokens x 100 ms
    assert table.max_cost("m@1", 4, 8) == 40 + 240 + 1200
    for completion in range(9):
        for compute_ms in (0, 1, 99.5, 1e9):
            assert table.cost("m@1", 4, completion, compute_ms) <= table.max_cost("m@1", 4, 8)
    assert table.cost("other@2", 1, 1, 0) == 2  # not in the table: the default price
