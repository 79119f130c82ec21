from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.tenants import KeyStore, Tenant, TenantError, ensure_dev_key, tiers_from


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KeyStore]:
    keys = KeyStore(tmp_path / "keys.sqlite3")
    yield keys
    keys.close()


def test_a_key_maps_to_its_tenant_until_revoked(store: KeyStore) -> None:
    store.put_tenant(Tenant("acme", "paid"))
    key_id, key = store.create_key("acme")
    assert store.authenticate(key) == Tenant("acme", "paid")
    assert store.authenticate(key + "x") is None and store.authenticate("nonsense") is None
    [info] = store.list_keys("acme")
    assert info.key_id == key_id and info.revoked_at_ms is None
    store.revoke(f"ais_{key_id}")
    assert store.authenticate(key) is None
    assert store.list_keys()[0].revoked_at_ms is not None
    with pytest.raises(TenantError):
        store.revoke(key_id)  # already revoked


def test_keys_are_stored_only_as_hashes(tmp_path: Path, store: KeyStore) -> None:
    store.put_tenant(Tenant("acme", "free"))
    _, key = store.create_key("acme")
    secret = key.split("_", 2)[2]
    for file in tmp_path.iterdir():
        assert secret.encode() not in file.read_bytes(), file


def test_tenant_checks(store: KeyStore) -> None:
    with pytest.raises(TenantError, match="tier"):
        store.put_tenant(Tenant("acme", "gold"))
    with pytest.raises(TenantError, match="tenant"):
        store.put_tenant(Tenant("Bad Name", "free"))
    with pytest.raises(TenantError, match="does not exist"):
        store.create_key("nobody")


def test_a_tenants_own_limits_override_its_tier() -> None:
    tiers = tiers_from(GatewayConfig())
    assert tiers["paid"].priority > tiers["free"].priority
    plan = Tenant("acme", "free", requests_per_minute=3, budget_micros=0).plan(tiers)
    assert plan.requests_per_minute == 3 and plan.budget_micros == 0
    assert plan.tokens_per_minute == tiers["free"].tokens_per_minute and plan.priority == tiers["free"].priority


def test_dev_key_is_made_once_and_replaced_when_revoked(tmp_path: Path) -> None:
    key = ensure_dev_key(tmp_path)
    assert (tmp_path / "dev.key").read_text().strip() == key
    assert (tmp_path / "dev.key").stat().st_mode & 0o077 == 0  # readable by its owner only
    assert ensure_dev_key(tmp_path) == key
    store = KeyStore(tmp_path / "keys.sqlite3")
    try:
        assert store.authenticate(key) == Tenant("dev", "paid")
        store.revoke(store.list_keys("dev")[0].key_id)
        fresh = ensure_dev_key(tmp_path)
        assert fresh != key and store.authenticate(fresh) is not None
    finally:
        store.close()
