"""The routes file: nothing until the first save, then exactly what was last saved, in order."""

from __future__ import annotations

from pathlib import Path

from services.gateway.route_store import RouteStore
from services.gateway.route_table import Role, Route, Stickiness, Version


def routes() -> list[Route]:
    return [
        Route("m", Stickiness.SESSION, [
            Version("m@2", "tok:2", "ipv4:10.0.0.1:1,10.0.0.2:1", 0, Role.STABLE),
            Version("m@1", "tok:1", "inf:1", 0, Role.RETIRING, retire_at=1_700_000_300.5),
            Version("m@3", "dns:///tok:3", "inf:3", 0, Role.CANARY, rolled_back_reason="slow"),
        ]),
        Route("a", Stickiness.NONE, [Version("a@1", "tok:9", "inf:9", 100, Role.STABLE)]),
    ]


def test_a_missing_file_has_no_routes_and_is_not_created(tmp_path: Path) -> None:
    store = RouteStore(tmp_path / "home" / "routes.sqlite3")
    assert store.load() == []
    assert not store.path.exists()


def test_what_is_saved_is_loaded_by_another_store(tmp_path: Path) -> None:
    path = tmp_path / "home" / "routes.sqlite3"
    RouteStore(path).save(routes())
    assert RouteStore(path).load() == routes()  # routes and versions in the order they were added


def test_a_save_replaces_everything(tmp_path: Path) -> None:
    store = RouteStore(tmp_path / "routes.sqlite3")
    store.save(routes())
    kept = routes()[1:]
    store.save(kept)
    assert store.load() == kept
