"""The cache service's Prometheus metrics, one set per server (docs/cache.md lists them).

Built before the cache opens (opening may already purge entries, and those removals count),
then registered in the server's own registry (``ServiceHandle.registry``): two cache servers in
one process never share or rebind a metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector, CollectorRegistry

from services.cache.record import NOT_EVICTIONS

_SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.88, 0.9, 0.93, 0.96, 0.99, 1.0)
_LOOKUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)  # seconds


class CacheSize(Protocol):
    """What the size gauges read: the cache's entry and vector counts."""

    @property
    def num_entries(self) -> int: ...

    @property
    def num_vectors(self) -> int: ...


class CacheMetrics:
    """Lookups, stores, evictions, feedback and the cache's size, of one cache server."""

    def __init__(self) -> None:
        # registry=None: created unregistered, registered in the server's registry by ``register``.
        self.lookups = Counter("aiserve_cache_lookups_total", "Cache lookups", ["result", "tier", "asked"],
                               registry=None)
        self.lookup_seconds = Histogram("aiserve_cache_lookup_seconds", "Lookup latency (embedding included)",
                                        ["result"], buckets=_LOOKUP_BUCKETS, registry=None)
        self.hit_similarity = Histogram("aiserve_cache_hit_similarity", "Similarity of cache hits", ["tier"],
                                        buckets=_SIMILARITY_BUCKETS, registry=None)
        self.stores = Counter("aiserve_cache_stores_total", "Store streams by outcome", ["outcome"], registry=None)
        self.evictions = Counter("aiserve_cache_evictions_total", "Entries removed without replacement",
                                 ["reason"], registry=None)
        self.entries = Gauge("aiserve_cache_entries", "Entries in the cache", registry=None)
        self.vectors = Gauge("aiserve_cache_vectors", "Vectors in the semantic index", registry=None)
        self.feedback = Counter("aiserve_cache_feedback_total", "Feedback on answers served from the cache",
                                ["negative"], registry=None)
        self.negative_feedback = Counter("aiserve_cache_negative_feedback_total",
                                         "Cache hits later given negative feedback", registry=None)
        self.feedback_similarity = Histogram("aiserve_cache_feedback_similarity",
                                             "Similarity of hits that got feedback", ["negative"],
                                             buckets=_SIMILARITY_BUCKETS, registry=None)

    def register(self, registry: CollectorRegistry, cache: CacheSize) -> None:
        """Add every metric to ``registry``; the size gauges read ``cache`` when scraped."""
        self.entries.set_function(lambda: cache.num_entries)
        self.vectors.set_function(lambda: cache.num_vectors)
        collectors: tuple[Collector, ...] = (
            self.lookups, self.lookup_seconds, self.hit_similarity, self.stores, self.evictions, self.entries,
            self.vectors, self.feedback, self.negative_feedback, self.feedback_similarity)
        for collector in collectors:
            registry.register(collector)

    def count_removal(self, reason: str, ids: Sequence[int]) -> None:
        """The record's removal hook: every removal but a replacement or an abandoned store is an eviction."""
        if reason not in NOT_EVICTIONS:
            self.evictions.labels(reason).inc(len(ids))

    def count_lookup(self, tier: str | None, similarity: float, seconds: float, asked: str) -> None:
        """One lookup: its tier ("exact", "semantic"; None = a miss), the hit's similarity, its
        latency, and the tiers it asked ("exact": no query; "both": with a query)."""
        result = "miss" if tier is None else "hit"
        self.lookup_seconds.labels(result).observe(seconds)
        self.lookups.labels(result, tier or "none", asked).inc()
        if tier is not None:
            self.hit_similarity.labels(tier).observe(similarity)

    def count_store(self, outcome: str) -> None:
        """One Store stream ended: "stored", "refused" or "abandoned"."""
        self.stores.labels(outcome).inc()

    def count_feedback(self, negative: bool, similarity: float) -> None:
        """One feedback report on a hit (``similarity`` 0 = not given)."""
        label = str(negative).lower()
        self.feedback.labels(label).inc()
        if negative:
            self.negative_feedback.inc()
        if similarity:
            self.feedback_similarity.labels(label).observe(similarity)
