"""The gateway's own Prometheus metrics, in its server's registry (one set per server, so two
gateways in one process never share or rebind a metric)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.gateway.cache_lookup import OUTCOMES
from services.gateway.domain import Final


class GatewayMetrics:
    """Finished generations, tokens billed and cost billed; cache lookups; whether the cache is in use."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("aiserve_gateway_requests_total",
                                "Finished generations, by the name@version that answered",
                                ["model", "finish_reason", "cache_hit"], registry=registry)
        self.tokens = Counter("aiserve_gateway_tokens_total", "Tokens billed", ["kind"], registry=registry)
        self.cost = Counter("aiserve_gateway_cost_micros_total", "Cost billed, in millionths of the currency",
                            ["tier"], registry=registry)
        self.cache_lookups = Counter(
            "aiserve_gateway_cache_lookups_total",
            "Cache lookups by how they ended: hit (before a generation started), hit_cancelled (the generation "
            "it raced was cancelled before its first token), late_hit (after the first token: generated, not "
            "stored), miss (failures included)", ["outcome"], registry=registry)
        for outcome in OUTCOMES:  # each reported from the start, at 0
            self.cache_lookups.labels(outcome)
        self.cache_available = Gauge("aiserve_gateway_cache_available",
                                     "1 while a cache replica is SERVING (else caching is skipped)", registry=registry)

    def set_cache_available(self, available: bool) -> None:
        """Whether answers are looked up in and stored to the cache now."""
        self.cache_available.set(1 if available else 0)

    def count_cache_lookup(self, outcome: str) -> None:
        """One cache lookup ended (services/gateway/cache_lookup.py, OUTCOMES)."""
        self.cache_lookups.labels(outcome).inc()

    def record(self, final: Final, tier: str) -> None:
        """Count one finished generation of a tenant of ``tier``."""
        self.requests.labels(final.usage.model, final.finish_reason, str(final.usage.cache_hit).lower()).inc()
        self.tokens.labels("prompt").inc(final.usage.prompt_tokens)
        self.tokens.labels("completion").inc(final.usage.completion_tokens)
        self.cost.labels(tier).inc(final.usage.cost_micros)
