"""The settings of the cache's parts, each default once: the record, the match rule, the index.

The cache service's settings (``CacheConfig``) embed these; the settings loader maps the flat
names (``AISERVE_CACHE_SIMILARITY_THRESHOLD``, ``--hnsw-m``) onto them, so a ``SemanticCache``
built in a test or a benchmark from the same values is the cache the service runs.
Pure Python: no faiss, no numpy, no grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.config import require
from aiserve.common.protocol import MAX_MESSAGE_BYTES

DEFAULT_SIMILARITY_THRESHOLD = 0.88
"""Measured with ``python -m services.cache.calibrate`` on services/cache/data/cache_pairs.jsonl:
the lowest threshold whose false-hit rate (and share of wrong hits) is <= 2% with the key-term
guard; see docs/cache.md for the table. tests/unit/cache/test_calibration.py holds it to that."""

INDEX_KINDS = ("flat", "hnsw")


@dataclass(frozen=True, slots=True)
class RecordConfig:
    """How the record keeps entries: how long, how many, how large, who shares them, and what
    removes them besides age and capacity."""

    ttl_s: float = 86400.0
    """Seconds an entry stays valid after it was stored (a Store may ask for less)."""
    max_entries: int = 100_000
    """Entries kept at most; past it the least recently used ones are evicted."""
    max_entry_bytes: int = 1 << 20
    """Largest entry stored, in bytes of prompt + query + answer text (UTF-8) + 4 per token id."""
    shared_across_tenants: bool = False
    """Off: a tenant never receives another tenant's answer. On: all tenants share one scope."""
    purge_old_versions: bool = True
    """A new version of a model name purges the entries of its other versions (turn off while
    two versions serve side by side, and invalidate by model instead)."""
    feedback_evict_after: int = 1
    """Negative feedback reports that remove an entry; 0 = count them only."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(self.ttl_s > 0, f"ttl_s: must be > 0 seconds, got {self.ttl_s}")
        require(1 <= self.max_entries <= 100_000_000,
                f"max_entries: must be 1..100000000, got {self.max_entries}")
        require(1024 <= self.max_entry_bytes <= MAX_MESSAGE_BYTES,  # a hit is returned in one message
                f"max_entry_bytes: must be 1024..{MAX_MESSAGE_BYTES} (64 MiB), got {self.max_entry_bytes}")
        require(self.feedback_evict_after >= 0, f"feedback_evict_after: must be >= 0, got {self.feedback_evict_after}")


@dataclass(frozen=True, slots=True)
class MatchRule:
    """When a stored query answers a new one by meaning."""

    similarity_threshold: float = DEFAULT_SIMILARITY_THRESHOLD
    """Lowest cosine similarity of a hit by meaning, 0..1. Requests can only ask for more."""
    key_term_guard: bool = True
    """A hit by meaning also needs numbers, negation, names and script to agree (guard.py)."""
    candidates: int = 8
    """Nearest stored queries examined per lookup, 1..256."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(0.0 < self.similarity_threshold <= 1.0,
                f"similarity_threshold: must be in (0, 1], got {self.similarity_threshold}")
        require(1 <= self.candidates <= 256, f"candidates: must be 1..256, got {self.candidates}")


@dataclass(frozen=True, slots=True)
class IndexParams:
    """How the vector index of each namespace is built."""

    index_kind: str = "flat"
    """"flat" (exact inner product) or "hnsw" (approximate, for large caches)."""
    hnsw_m: int = 32
    """hnsw: neighbours per node, 4..128."""
    hnsw_ef_construction: int = 80
    """hnsw: candidate list size while inserting, 8..1024."""
    hnsw_ef_search: int = 64
    """hnsw: candidate list size while searching, 8..1024 (higher: better recall, slower)."""
    index_build_threads: int = 0
    """faiss's OpenMP threads while the index is rebuilt from the record as the cache opens
    (0: every CPU this process may use). Nothing is served yet then, so the build takes the
    cores; searches run on ``index_threads`` (CacheConfig) afterwards."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(self.index_kind in INDEX_KINDS, f"index_kind: must be flat or hnsw, got {self.index_kind!r}")
        require(4 <= self.hnsw_m <= 128, f"hnsw_m: must be 4..128, got {self.hnsw_m}")
        require(8 <= self.hnsw_ef_construction <= 1024,
                f"hnsw_ef_construction: must be 8..1024, got {self.hnsw_ef_construction}")
        require(8 <= self.hnsw_ef_search <= 1024, f"hnsw_ef_search: must be 8..1024, got {self.hnsw_ef_search}")
        require(0 <= self.index_build_threads <= 256,
                f"index_build_threads: must be 0..256, got {self.index_build_threads}")
