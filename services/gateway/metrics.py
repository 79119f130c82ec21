"""The gateway's own Prometheus metrics, in its server's registry (one set per server, so two
gateways in one process never share or rebind a metric)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from services.gateway.domain import Final


class GatewayMetrics:
    """Finished generations, tokens billed and cost billed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("aiserve_gateway_requests_total", "Finished generations",
                                ["finish_reason", "cache_hit"], registry=registry)
        self.tokens = Counter("aiserve_gateway_tokens_total", "Tokens billed", ["kind"], registry=registry)
        self.cost = Counter("aiserve_gateway_cost_micros_total", "Cost billed, in millionths of the currency",
                            ["tier"], registry=registry)

    def record(self, final: Final, tier: str) -> None:
        """Count one finished generation of a tenant of ``tier``."""
        self.requests.labels(final.finish_reason, str(final.usage.cache_hit).lower()).inc()
        self.tokens.labels("prompt").inc(final.usage.prompt_tokens)
        self.tokens.labels("completion").inc(final.usage.completion_tokens)
        self.cost.labels(tier).inc(final.usage.cost_micros)
