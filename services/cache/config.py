"""Settings of the cache service (DESIGN.md §1: port 50054, metrics 9104)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.common.paths import CACHE_DB_FILE, home_file
from services.cache.index import INDEX_KINDS, IndexParams

DEFAULT_SIMILARITY_THRESHOLD = 0.88
"""Measured with ``python -m services.cache.calibrate`` on services/cache/data/cache_pairs.jsonl:
the lowest threshold whose false-hit rate (and share of wrong hits) is <= 2% with the key-term
guard; see docs/cache.md for the table. tests/unit/cache/test_calibration.py holds it to that."""


@dataclass(frozen=True)
class CacheConfig(ServiceConfig):
    """Settings of the cache service: files, lifecycle limits, the match rule and the index."""

    port: int = 50054
    """gRPC port of the cache service."""
    metrics_port: int = 9104
    """Prometheus HTTP port; 0 disables the metrics endpoint."""
    db_path: str = ""
    """SQLite file, the record of every entry; "" = $AISERVE_HOME/cache/cache.sqlite3."""
    index_path: str = ""
    """Snapshot of the faiss index, rebuilt from SQLite when missing, corrupt or stale;
    "" = the SQLite file's path with the suffix .faiss."""
    ttl_s: float = 86400.0
    """Seconds an entry stays valid after it was stored (a Store may ask for less)."""
    max_entries: int = 100_000
    """Entries kept at most; past it the least recently used ones are evicted."""
    max_entry_bytes: int = 1 << 20
    """Largest entry stored, in bytes of prompt + query + answer text (UTF-8) + 4 per token id."""
    similarity_threshold: float = DEFAULT_SIMILARITY_THRESHOLD
    """Lowest cosine similarity of a hit by meaning, 0..1. Requests can only ask for more."""
    key_term_guard: bool = True
    """A hit by meaning also needs numbers, negation, names and script to agree (guard.py)."""
    candidates: int = 8
    """Nearest stored queries examined per lookup, 1..256."""
    index_kind: str = "flat"
    """"flat" (exact inner product) or "hnsw" (approximate, for large caches)."""
    hnsw_m: int = 32
    """hnsw: neighbours per node, 4..128."""
    hnsw_ef_construction: int = 80
    """hnsw: candidate list size while inserting, 8..1024."""
    hnsw_ef_search: int = 64
    """hnsw: candidate list size while searching, 8..1024 (higher: better recall, slower)."""
    shared_across_tenants: bool = False
    """Off: a tenant never receives another tenant's answer. On: all tenants share one scope."""
    purge_old_versions: bool = True
    """A new version of a model name purges the entries of its other versions (turn off while
    two versions serve side by side, and invalidate by model instead)."""
    feedback_evict_after: int = 1
    """Negative feedback reports that remove an entry; 0 = count them only."""
    embedding_device: str = "cpu"
    """torch device of the embedding model."""
    embedding_threads: int = 1
    """torch threads of the embedding model (the suite gives the cores to inference); 0 = torch's default."""
    index_threads: int = 1
    """OpenMP threads of faiss. One query at a time is fastest on one thread: more threads cost
    milliseconds of hand-off per search (measured: 8 ms instead of 0.15 ms at 3,000 entries)."""
    query_cache_size: int = 1024
    """Query embeddings kept in memory, so a Store reuses the vector its Lookup computed."""

    def validate(self) -> None:
        super().validate()
        require(self.ttl_s > 0, f"ttl_s: must be > 0 seconds, got {self.ttl_s}")
        require(1 <= self.max_entries <= 100_000_000,
                f"max_entries: must be 1..100000000, got {self.max_entries}")
        require(1024 <= self.max_entry_bytes <= 64 << 20,
                f"max_entry_bytes: must be 1024..{64 << 20} (64 MiB), got {self.max_entry_bytes}")
        require(0.0 < self.similarity_threshold <= 1.0,
                f"similarity_threshold: must be in (0, 1], got {self.similarity_threshold}")
        require(1 <= self.candidates <= 256, f"candidates: must be 1..256, got {self.candidates}")
        require(self.index_kind in INDEX_KINDS, f"index_kind: must be flat or hnsw, got {self.index_kind!r}")
        require(4 <= self.hnsw_m <= 128, f"hnsw_m: must be 4..128, got {self.hnsw_m}")
        require(8 <= self.hnsw_ef_construction <= 1024,
                f"hnsw_ef_construction: must be 8..1024, got {self.hnsw_ef_construction}")
        require(8 <= self.hnsw_ef_search <= 1024, f"hnsw_ef_search: must be 8..1024, got {self.hnsw_ef_search}")
        require(self.feedback_evict_after >= 0, f"feedback_evict_after: must be >= 0, got {self.feedback_evict_after}")
        require(0 <= self.embedding_threads <= 256, f"embedding_threads: must be 0..256, got {self.embedding_threads}")
        require(1 <= self.index_threads <= 256, f"index_threads: must be 1..256, got {self.index_threads}")
        require(0 <= self.query_cache_size <= 1_000_000,
                f"query_cache_size: must be 0..1000000, got {self.query_cache_size}")

    def resolved_db_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The SQLite file to open: ``db_path``, or the default under ``AISERVE_HOME``."""
        return home_file(self.db_path, CACHE_DB_FILE, environ)

    def resolved_index_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The index snapshot: ``index_path``, or next to the SQLite file."""
        if self.index_path:
            return Path(self.index_path)
        return self.resolved_db_path(environ).with_suffix(".faiss")

    def index_params(self) -> IndexParams:
        return IndexParams(self.index_kind, self.hnsw_m, self.hnsw_ef_construction, self.hnsw_ef_search)
