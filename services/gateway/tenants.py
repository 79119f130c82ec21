"""Tenants, their tiers, and the API keys that map to them (stored only as hashes).

A key is ``ais_<id>_<secret>``: the id (8 hex characters) names the key in listings and
revocations, the secret (32 random bytes) makes it unguessable. The store keeps the key's
sha256 and its id, never the key: a full-entropy random secret needs no slow password hash,
and a lookup by hash costs one index probe. The store is SQLite (WAL), shared by the gateway
(reads on every call) and ``aiserve keys`` (writes, from another process). No grpc, no pb.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path

from aiserve.common.paths import DEV_KEY_FILE, KEYS_FILE
from services.gateway.config import GatewayConfig

TIERS = ("free", "paid")
DEV_TENANT = "dev"
_TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_KEY_RE = re.compile(r"^ais_([0-9a-f]{8})_[A-Za-z0-9_-]{20,}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    tier TEXT NOT NULL,
    requests_per_minute INTEGER,  -- NULL = the tier's
    tokens_per_minute INTEGER,    -- NULL = the tier's
    budget_micros INTEGER,        -- NULL = the tier's; 0 = none
    created_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_sha256 TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL REFERENCES tenants(name),
    created_at_ms INTEGER NOT NULL,
    revoked_at_ms INTEGER          -- NULL = valid
);
"""


class TenantError(ValueError):
    """A keys command cannot be done (unknown tenant or key, bad name); the message says why."""


@dataclass(frozen=True, slots=True)
class Tier:
    """What a tier grants: scheduling priority, rate limits and a budget per period."""

    name: str
    priority: int
    requests_per_minute: int
    tokens_per_minute: int
    budget_micros: int
    """Spending cap per budget period, in micros; 0 = none."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A customer: its tier, and limits of its own where it has them (None = the tier's)."""

    name: str
    tier: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    budget_micros: int | None = None

    def plan(self, tiers: dict[str, Tier]) -> Tier:
        """The tier's grants with this tenant's own limits applied."""
        base = tiers[self.tier]
        return replace(
            base,
            requests_per_minute=self.requests_per_minute or base.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute or base.tokens_per_minute,
            budget_micros=base.budget_micros if self.budget_micros is None else self.budget_micros,
        )


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One key as listings show it (never the key itself)."""

    key_id: str
    tenant: str
    tier: str
    created_at_ms: int
    revoked_at_ms: int | None


def tiers_from(config: GatewayConfig) -> dict[str, Tier]:
    """The tiers the gateway's settings define."""
    return {
        name: Tier(
            name,
            priority=getattr(config, f"{name}_priority"),
            requests_per_minute=getattr(config, f"{name}_requests_per_minute"),
            tokens_per_minute=getattr(config, f"{name}_tokens_per_minute"),
            budget_micros=getattr(config, f"{name}_budget_micros"),
        )
        for name in TIERS
    }


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)


class KeyStore:
    """Tenants and key hashes in SQLite. One connection, used from one thread at a time."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant of a valid key; None for an unknown, malformed or revoked one."""
        if not _KEY_RE.match(key):
            return None
        row = self._db.execute(
            "SELECT t.name, t.tier, t.requests_per_minute, t.tokens_per_minute, t.budget_micros "
            "FROM api_keys k JOIN tenants t ON t.name = k.tenant "
            "WHERE k.key_sha256 = ? AND k.revoked_at_ms IS NULL",
            (hash_key(key),),
        ).fetchone()
        return None if row is None else Tenant(*row)

    def tenant(self, name: str) -> Tenant | None:
        row = self._db.execute(
            "SELECT name, tier, requests_per_minute, tokens_per_minute, budget_micros FROM tenants WHERE name = ?",
            (name,),
        ).fetchone()
        return None if row is None else Tenant(*row)

    def put_tenant(self, tenant: Tenant) -> Tenant:
        """Create the tenant, or change its tier and own limits."""
        if not _TENANT_RE.match(tenant.name):
            raise TenantError(f"tenant: must match {_TENANT_RE.pattern}, got {tenant.name!r}")
        if tenant.tier not in TIERS:
            raise TenantError(f"tier: must be one of {', '.join(TIERS)}, got {tenant.tier!r}")
        for field in ("requests_per_minute", "tokens_per_minute", "budget_micros"):
            value = getattr(tenant, field)
            if value is not None and value < (0 if field == "budget_micros" else 1):
                raise TenantError(f"{field}: must be >= {0 if field == 'budget_micros' else 1}, got {value}")
        self._db.execute(
            "INSERT INTO tenants VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET tier = excluded.tier, "
            "requests_per_minute = excluded.requests_per_minute, tokens_per_minute = excluded.tokens_per_minute, "
            "budget_micros = excluded.budget_micros",
            (tenant.name, tenant.tier, tenant.requests_per_minute, tenant.tokens_per_minute,
             tenant.budget_micros, _now_ms()),
        )
        return tenant

    def create_key(self, tenant: str) -> tuple[str, str]:
        """A new key for an existing tenant: (key id, key). The key is shown once, never stored."""
        if self.tenant(tenant) is None:
            raise TenantError(f"tenant: {tenant!r} does not exist")
        while True:
            key_id = secrets.token_hex(4)
            key = f"ais_{key_id}_{secrets.token_urlsafe(32)}"
            try:
                self._db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, NULL)",
                                 (key_id, hash_key(key), tenant, _now_ms()))
                return key_id, key
            except sqlite3.IntegrityError:  # a key id collision (1 in 4 billion): draw again
                continue

    def revoke(self, key_id: str) -> None:
        """Revoke a key by its id (``ais_<id>`` or ``<id>``); later calls with it are UNAUTHENTICATED."""
        key_id = key_id.removeprefix("ais_")
        updated = self._db.execute(
            "UPDATE api_keys SET revoked_at_ms = ? WHERE key_id = ? AND revoked_at_ms IS NULL", (_now_ms(), key_id)
        ).rowcount
        if not updated:
            raise TenantError(f"key: no valid key with id {key_id!r}")

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        rows = self._db.execute(
            "SELECT k.key_id, k.tenant, t.tier, k.created_at_ms, k.revoked_at_ms FROM api_keys k "
            "JOIN tenants t ON t.name = k.tenant WHERE ? IS NULL OR k.tenant = ? ORDER BY k.created_at_ms",
            (tenant, tenant),
        ).fetchall()
        return [KeyInfo(*row) for row in rows]


def ensure_dev_key(home: Path) -> str:
    """The development tenant's key in ``$AISERVE_HOME/dev.key``, made on first use (idempotent:
    a key that still authenticates is kept; a missing or revoked one is replaced)."""
    path = home / DEV_KEY_FILE
    store = KeyStore(home / KEYS_FILE)
    try:
        if path.is_file() and store.authenticate(key := path.read_text().strip()) is not None:
            return key
        if store.tenant(DEV_TENANT) is None:
            store.put_tenant(Tenant(DEV_TENANT, "paid"))
        _, key = store.create_key(DEV_TENANT)
    finally:
        store.close()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    return key
