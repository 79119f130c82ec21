"""Prices per model version, and what a request costs: its tokens and its compute time
(docs/gateway.md, "Costs").

Costs are integers in millionths of the configured currency unit ("micros"). No grpc, no pb.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from aiserve.common.config import ConfigError

_ENTRY_RE = re.compile(r"^(?P<model>[^=\s]+@[^=\s]+)=(?P<prompt>\d+)/(?P<completion>\d+)/(?P<compute>\d+)$")


@dataclass(frozen=True, slots=True)
class Price:
    """What one model version charges, in micros."""

    prompt_per_token: int
    completion_per_token: int
    compute_per_second: int


def parse_prices(entries: Iterable[str]) -> dict[str, Price]:
    """"name@version=PROMPT/COMPLETION/COMPUTE" entries -> {model: Price}; ConfigError names a bad one."""
    table: dict[str, Price] = {}
    for entry in entries:
        match = _ENTRY_RE.match(entry.strip())
        if match is None:
            raise ConfigError(
                f"prices: entry {entry!r} must be 'name@version=PROMPT/COMPLETION/COMPUTE' "
                "(integer micros per prompt token, per generated token, per compute-second)"
            )
        table[match["model"]] = Price(int(match["prompt"]), int(match["completion"]), int(match["compute"]))
    return table


class PriceTable:
    """The price of every model version; models missing from the table pay ``default``.

    A request's compute charge is capped at ``max_compute_ms_per_token`` per token it
    processed, so its cost never exceeds ``max_cost`` (what admission reserves) and concurrent
    requests can never overshoot a budget.
    """

    def __init__(self, prices: dict[str, Price], default: Price, max_compute_ms_per_token: int) -> None:
        self.prices = prices
        self.default = default
        self.max_compute_ms_per_token = max_compute_ms_per_token

    def price(self, model: str) -> Price:
        return self.prices.get(model, self.default)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int, compute_ms: float) -> int:
        """Micros of one request: its tokens, plus its compute time up to the cap."""
        price = self.price(model)
        billed_ms = min(max(compute_ms, 0.0), (prompt_tokens + completion_tokens) * self.max_compute_ms_per_token)
        return (
            prompt_tokens * price.prompt_per_token
            + completion_tokens * price.completion_per_token
            + math.ceil(billed_ms * price.compute_per_second / 1000)
        )

    def max_cost(self, model: str, prompt_tokens: int, max_new_tokens: int) -> int:
        """The most a request of this size can cost (every token generated, compute at its cap)."""
        return self.cost(model, prompt_tokens, max_new_tokens, math.inf)
