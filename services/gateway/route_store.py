"""The model routes on disk: a SQLite file ($AISERVE_HOME/routes.sqlite3, setting
``routes_path``) that the gateway reads at start and writes after each admin change.

Pure sqlite3, no grpc. Each save replaces every row in one transaction, so a crash leaves the
routes before or after a change, never half of one. The file is created by the first save: a
gateway whose routes were never changed serves its settings' route and writes nothing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.gateway.route_table import Role, Route, Stickiness, Version

_SCHEMA = """
CREATE TABLE IF NOT EXISTS routes (
    name TEXT PRIMARY KEY,
    position INTEGER NOT NULL,
    stickiness TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    model TEXT PRIMARY KEY,
    route TEXT NOT NULL REFERENCES routes(name),
    position INTEGER NOT NULL,
    tokenizer_target TEXT NOT NULL,
    inference_target TEXT NOT NULL,
    weight INTEGER NOT NULL,
    role TEXT NOT NULL,
    rolled_back_reason TEXT NOT NULL,
    retire_at REAL NOT NULL
);
"""


class RouteStore:
    """The routes file at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[Route]:
        """The routes as last saved, in the order they were added ([] when none were saved)."""
        if not self.path.exists():
            return []
        with _connect(self.path) as db:
            routes = {name: Route(name, Stickiness(stickiness)) for name, stickiness in
                      db.execute("SELECT name, stickiness FROM routes ORDER BY position")}
            rows = db.execute("SELECT route, model, tokenizer_target, inference_target, weight, role, "
                              "rolled_back_reason, retire_at FROM versions ORDER BY route, position")
            for route, model, tokenizer, inference, weight, role, reason, retire_at in rows:
                routes[route].versions.append(Version(model, tokenizer, inference, weight, Role(role), reason,
                                                      retire_at))
        return [r for r in routes.values() if r.versions]

    def save(self, routes: list[Route]) -> None:
        """Replace what the file holds with ``routes``, in one transaction."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _connect(self.path) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM versions")
                db.execute("DELETE FROM routes")
                db.executemany("INSERT INTO routes VALUES (?, ?, ?)",
                               [(r.name, i, r.stickiness.value) for i, r in enumerate(routes)])
                db.executemany("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
                    (v.model, r.name, i, v.tokenizer_target, v.inference_target, v.weight, v.role.value,
                     v.rolled_back_reason, v.retire_at)
                    for r in routes for i, v in enumerate(r.versions)])
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")


@contextmanager
def _connect(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection to the routes file (its tables made when new), closed on exit."""
    db = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        yield db
    finally:
        db.close()
