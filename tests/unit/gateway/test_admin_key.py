"""The admin key file: made once, kept, refused when malformed."""

from __future__ import annotations

import stat
from pathlib import Path

from aiserve.common.paths import ADMIN_KEY_FILE, home_file
from services.gateway.admin_key import ensure_admin_key, is_admin_key, matches, read_admin_key


def test_the_key_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "home" / "admin.key"
    key = ensure_admin_key(path)
    assert is_admin_key(key) and read_admin_key(path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_admin_key(path) == key  # a second start keeps it


def test_a_malformed_file_is_no_key_and_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    path.write_text("ais_12345678_tenantkey\n")  # a tenant's key is not an admin key
    assert read_admin_key(path) is None
    key = ensure_admin_key(path)
    assert key != "ais_12345678_tenantkey" and read_admin_key(path) == key


def test_matching_is_exact() -> None:
    key = "aisadm_" + "ab" * 32
    assert matches(key, key)
    assert not matches(key[:-1] + "c", key) and not matches("", key)


def test_the_default_key_file_is_admin_key_under_the_home(tmp_path: Path) -> None:
    assert home_file("", ADMIN_KEY_FILE, {"AISERVE_HOME": str(tmp_path)}) == tmp_path / "admin.key"
