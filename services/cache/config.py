"""Settings of the cache service (``AISERVE_CACHE_*``; gRPC port 50054, metrics 9104)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiserve.common.config import ServiceConfig, require
from aiserve.common.paths import CACHE_DB_FILE, home_file
from services.cache.component_config import IndexParams, MatchRule, RecordConfig
from services.cache.precision import AUTO as EMBEDDING_AUTO
from services.cache.precision import DTYPES as EMBEDDING_DTYPES


@dataclass(frozen=True)
class CacheConfig(ServiceConfig):
    """Settings of the cache service: files, the record's limits, the match rule, the index and
    the embedding model."""

    port: int = 50054
    """gRPC port of the cache service."""
    metrics_port: int = 9104
    """Prometheus HTTP port; 0 disables the metrics endpoint."""
    db_path: str = ""
    """SQLite file, the record of every entry; "" = $AISERVE_HOME/cache/cache.sqlite3."""
    index_path: str = ""
    """Snapshot of the faiss index, rebuilt from SQLite when missing, corrupt or stale;
    "" = the SQLite file's path with the suffix .faiss."""
    record: RecordConfig = field(default_factory=RecordConfig)
    """Entry lifetime, capacity, size and removal, given by their own flat names: ``ttl_s``,
    ``max_entries``, ``max_entry_bytes``, ``shared_across_tenants``, ``purge_old_versions``,
    ``feedback_evict_after`` (services/cache/component_config.py)."""
    match_rule: MatchRule = field(default_factory=MatchRule)
    """When a stored query answers a new one: ``similarity_threshold``, ``key_term_guard``,
    ``candidates``."""
    index: IndexParams = field(default_factory=IndexParams)
    """How the vector index is built: ``index_kind``, ``hnsw_m``, ``hnsw_ef_construction``,
    ``hnsw_ef_search``, ``index_build_threads``."""
    embedding_device: str = "cpu"
    """torch device of the embedding model."""
    embedding_dtype: str = EMBEDDING_AUTO
    """dtype of the embedding model's products: "auto" (bfloat16 where the CPU has bf16
    instructions, else float32: ``precision.choose_dtype``), "float32" or "bfloat16"."""
    embedding_threads: int = 1
    """torch threads of the embedding model (the suite gives the cores to inference); 0 = torch's default."""
    index_threads: int = 1
    """OpenMP threads of faiss. One query at a time is fastest on one thread: more threads cost
    milliseconds of hand-off per search (measured: 8 ms instead of 0.15 ms at 3,000 entries)."""
    query_cache_size: int = 1024
    """Query embeddings kept in memory, so a Store reuses the vector its Lookup computed."""
    lookup_delay_ms: int = 0
    """A TEST setting: every Lookup waits this long before it answers (an asyncio sleep: the
    service's other calls go on), so tests can make the cache slow on purpose and check that a
    miss's first token never waits for it; 0 = off. 0..60000."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        super().validate()
        self.record.validate()
        self.match_rule.validate()
        self.index.validate()
        require(self.embedding_dtype in (EMBEDDING_AUTO, *EMBEDDING_DTYPES),
                f"embedding_dtype: must be auto, {' or '.join(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}")
        require(0 <= self.embedding_threads <= 256, f"embedding_threads: must be 0..256, got {self.embedding_threads}")
        require(1 <= self.index_threads <= 256, f"index_threads: must be 1..256, got {self.index_threads}")
        require(0 <= self.query_cache_size <= 1_000_000,
                f"query_cache_size: must be 0..1000000, got {self.query_cache_size}")
        require(0 <= self.lookup_delay_ms <= 60_000, f"lookup_delay_ms: must be 0..60000, got {self.lookup_delay_ms}")

    def resolved_db_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The SQLite file to open: ``db_path``, or the default under ``AISERVE_HOME``."""
        return home_file(self.db_path, CACHE_DB_FILE, environ)

    def resolved_index_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The index snapshot: ``index_path``, or next to the SQLite file."""
        if self.index_path:
            return Path(self.index_path)
        return self.resolved_db_path(environ).with_suffix(".faiss")
