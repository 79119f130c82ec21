"""Settings of the cache service (DESIGN.md §1: port 50054, metrics 9104)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiserve.common.config import ServiceConfig, aiserve_home, require


@dataclass(frozen=True)
class CacheConfig(ServiceConfig):
    """Settings of the cache service: where its SQLite file lives, TTL and size limits."""

    port: int = 50054
    """gRPC port of the cache service."""
    metrics_port: int = 9104
    """Prometheus HTTP port; 0 disables the metrics endpoint."""
    db_path: str = ""
    """SQLite file of the exact-match tier; "" = $AISERVE_HOME/cache/cache.sqlite3."""
    ttl_s: float = 86400.0
    """Seconds an entry stays valid after it was stored; older entries are never returned."""
    max_entries: int = 100_000
    """Entries kept at most; past it the least recently used ones are evicted."""
    max_entry_bytes: int = 1 << 20
    """Largest entry stored, in bytes of prompt + answer text (UTF-8) + 4 per token id."""

    def validate(self) -> None:
        super().validate()
        require(self.ttl_s > 0, f"ttl_s: must be > 0 seconds, got {self.ttl_s}")
        require(1 <= self.max_entries <= 100_000_000,
                f"max_entries: must be 1..100000000, got {self.max_entries}")
        require(1024 <= self.max_entry_bytes <= 64 << 20,
                f"max_entry_bytes: must be 1024..{64 << 20} (64 MiB), got {self.max_entry_bytes}")

    def resolved_db_path(self, environ: Mapping[str, str] | None = None) -> Path:
        """The SQLite file to open: ``db_path``, or the default under ``AISERVE_HOME``."""
        if self.db_path:
            return Path(self.db_path)
        return aiserve_home(environ) / "cache" / "cache.sqlite3"
