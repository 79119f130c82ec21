"""The gateway's own Prometheus metrics, in its server's registry (one set per server, so two
gateways in one process never share or rebind a metric)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.accounting import CallOutcome
from services.gateway.cache_lookup import OUTCOMES
from services.gateway.config import GatewayConfig
from services.gateway.domain import Final
from services.gateway.replicas import State

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
_LENGTH_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)


def with_targets(buckets: tuple[float, ...], *targets: float) -> list[float]:
    """``buckets`` with every target added as a bound of its own, in order, without duplicates."""
    return sorted({*buckets, *targets})


class GatewayMetrics:
    """Finished generations, tokens billed and cost billed; cache lookups; whether the cache is in use."""

    def __init__(self, registry: CollectorRegistry, config: GatewayConfig | None = None) -> None:
        """The latency histograms' bounds include ``config``'s SLO targets (slo_ttft_s, slo_tpot_s,
        slo_e2e_s), so that "the share of requests within target" is exact, not interpolated."""
        slo = config or GatewayConfig()
        self.requests = Counter("aiserve_gateway_requests_total",
                                "Finished generations, by the name@version that answered",
                                ["model", "finish_reason", "cache_hit"], registry=registry)
        self.calls = Counter("aiserve_gateway_calls_total",
                             "Generate and Complete calls (gRPC and HTTP) by how they ended: the name@version "
                             "routed to, the tenant's tier and the status code", ["model", "tier", "code"],
                             registry=registry)
        self.tokens = Counter("aiserve_gateway_tokens_total", "Tokens billed, by the tenant's tier",
                              ["kind", "tier"], registry=registry)
        self.cost = Counter("aiserve_gateway_cost_micros_total", "Cost billed, in millionths of the currency",
                            ["tier"], registry=registry)
        self.feedback = Counter("aiserve_gateway_feedback_total",
                                "Feedback recorded: ratings (good, bad) and passive signals (abandoned, repeat)",
                                ["kind"], registry=registry)
        for kind in ("good", "bad", "abandoned", "repeat"):  # each reported from the start, at 0
            self.feedback.labels(kind)
        self.cache_lookups = Counter(
            "aiserve_gateway_cache_lookups_total",
            "Cache lookups by how they ended: hit (before a generation started), hit_cancelled (the generation "
            "it raced was cancelled before its first token), late_hit (after the first token: generated, not "
            "stored), miss (failures included)", ["outcome"], registry=registry)
        for outcome in OUTCOMES:  # each reported from the start, at 0
            self.cache_lookups.labels(outcome)
        self.cache_available = Gauge("aiserve_gateway_cache_available",
                                     "1 while a cache replica is SERVING (else caching is skipped)", registry=registry)
        self.ttft = Histogram("aiserve_gateway_ttft_seconds", "Time to first token, by the name@version that answered",
                              ["model"], buckets=with_targets(_LATENCY_BUCKETS, slo.slo_ttft_s), registry=registry)
        self.tpot = Histogram("aiserve_gateway_time_per_output_token_seconds",
                              "Time per output token after the first (generations of 2 tokens or more)",
                              ["model"], buckets=with_targets(_TOKEN_BUCKETS, slo.slo_tpot_s), registry=registry)
        self.e2e = Histogram("aiserve_gateway_e2e_seconds", "A generation end to end, admission to last token",
                             ["model"], buckets=with_targets(_LATENCY_BUCKETS, slo.slo_e2e_s), registry=registry)
        self.queue = Histogram("aiserve_gateway_queue_seconds", "Time a generation waited in the inference queue",
                               ["model"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.output_tokens = Histogram("aiserve_gateway_output_tokens", "Tokens generated per request (answer length)",
                                       ["model"], buckets=_LENGTH_BUCKETS, registry=registry)

    def set_cache_available(self, available: bool) -> None:
        """Whether answers are looked up in and stored to the cache now."""
        self.cache_available.set(1 if available else 0)

    def count_cache_lookup(self, outcome: str) -> None:
        """One cache lookup ended (services/gateway/cache_lookup.py, OUTCOMES)."""
        self.cache_lookups.labels(outcome).inc()

    def count_call(self, outcome: CallOutcome) -> None:
        """One Generate/Complete call ended (its ledger row was written): its code, and what it billed."""
        self.calls.labels(outcome.model, outcome.tier, outcome.code).inc()
        self.tokens.labels("prompt", outcome.tier).inc(outcome.prompt_tokens)
        self.tokens.labels("completion", outcome.tier).inc(outcome.completion_tokens)
        self.cost.labels(outcome.tier).inc(outcome.cost_micros)

    def count_feedback(self, kind: str) -> None:
        """One feedback row was written (services/gateway/feedback.py)."""
        self.feedback.labels(kind).inc()

    def record(self, final: Final) -> None:
        """Observe one finished generation (its outcome and bill are ``count_call``'s)."""
        self.requests.labels(final.usage.model, final.finish_reason, str(final.usage.cache_hit).lower()).inc()
        u = final.usage
        self.ttft.labels(u.model).observe(u.ttft_ms / 1000)
        self.e2e.labels(u.model).observe(u.total_ms / 1000)
        self.queue.labels(u.model).observe(u.queue_ms / 1000)
        self.output_tokens.labels(u.model).observe(u.completion_tokens)
        if u.completion_tokens >= 2:
            self.tpot.labels(u.model).observe(max(0, u.total_ms - u.ttft_ms) / 1000 / (u.completion_tokens - 1))


class Watched(Protocol):
    """A replica as the gauges read it (``replica.py``'s ``Replica``)."""

    @property
    def state(self) -> State: ...


class Pool(Protocol):
    """The replicas of one service for one model (``pool.py``'s ``ReplicaPool``; grpc stays there)."""

    @property
    def service(self) -> str: ...

    @property
    def route(self) -> str:
        """The name@version served ("" for the cache, shared by every route)."""
        ...

    @property
    def replicas(self) -> Iterable[Watched]: ...


class ReplicaCollector(Collector):
    """The replicas of every route's versions (and the cache's), counted at scrape time: how
    many each pool knows and how many of them are SERVING now."""

    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """``aiserve_gateway_replicas`` and ``aiserve_gateway_healthy_replicas`` by model and service."""
        known = GaugeMetricFamily("aiserve_gateway_replicas", "Replicas the gateway knows, by the name@version "
                                  "they serve ('' for the cache) and service", labels=["model", "service"])
        healthy = GaugeMetricFamily("aiserve_gateway_healthy_replicas", "Replicas whose health watch says SERVING "
                                    "now, by the name@version they serve ('' for the cache) and service",
                                    labels=["model", "service"])
        for pool in self._pools():
            replicas = list(pool.replicas)
            known.add_metric([pool.route, pool.service], len(replicas))
            healthy.add_metric([pool.route, pool.service], sum(r.state is State.SERVING for r in replicas))
        yield known
        yield healthy
