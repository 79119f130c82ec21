"""ExactCache (the record and the exact tier) on a real SQLite file: hits, scopes, TTL, LRU,
persistence, invalidation, feedback, validation."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from aiserve.common.errors import InvalidArgument
from services.cache.exact import CacheScope, ExactCache

SCOPE = CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="temperature=0")


class FakeClock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Evictions:
    """Counts removals by reason, as the service's metrics do (a replaced entry is no eviction)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.ids: list[int] = []

    def __call__(self, reason: str, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        if reason != "replace":
            self.counts[reason] = self.counts.get(reason, 0) + len(ids)


def open_cache(path: Path, clock: FakeClock, evictions: Evictions | None = None,
               max_entries: int = 100, ttl_s: float = 60.0) -> ExactCache:
    return ExactCache(path, ttl_s=ttl_s, max_entries=max_entries, max_entry_bytes=4096,
                      clock=clock, on_remove=evictions or Evictions())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cache(tmp_path: Path, clock: FakeClock) -> Iterator[ExactCache]:
    cache = open_cache(tmp_path / "cache.sqlite3", clock)
    try:
        yield cache
    finally:
        cache.close()


def test_store_then_lookup_hits_with_the_same_answer(cache: ExactCache) -> None:
    entry_id = cache.store(SCOPE, "Hello?", "Hi there.", (12, 7, 0, 4294967295), "stop").entry_id
    entry = cache.lookup(SCOPE, "Hello?")
    assert entry is not None
    assert entry.entry_id == entry_id
    assert entry.deltas == ((9, 4),)  # stored whole: one delta
    assert (entry.text, entry.token_ids, entry.finish_reason) == ("Hi there.", (12, 7, 0, 4294967295), "stop")
    assert cache.lookup(SCOPE, "Hello") is None
    assert cache.num_entries == 1


@pytest.mark.parametrize("other", [
    CacheScope(SCOPE.model, "globex", SCOPE.params),
    CacheScope("smollm2-135m-instruct@0.1.3", SCOPE.tenant, SCOPE.params),
    CacheScope(SCOPE.model, SCOPE.tenant, "temperature=0.7"),
    CacheScope(SCOPE.model, "", SCOPE.params),
    CacheScope(SCOPE.model, SCOPE.tenant, SCOPE.params, context='[["system","Answer in French."]]'),
])
def test_other_scope_never_hits(cache: ExactCache, other: CacheScope) -> None:
    cache.store(SCOPE, "Hello?", "Hi there.", (1, 2), "stop")
    assert cache.lookup(other, "Hello?") is None


def test_key_parts_cannot_bleed_into_each_other(cache: ExactCache) -> None:
    cache.store(CacheScope("m@1", "ab", "c"), "p", "answer", (1,), "stop")
    assert cache.lookup(CacheScope("m@1", "a", "bc"), "p") is None


def test_store_replaces_the_entry_of_the_same_key(cache: ExactCache) -> None:
    first = cache.store(SCOPE, "Hello?", "old", (1,), "length").entry_id
    second = cache.store(SCOPE, "Hello?", "new", (2,), "stop").entry_id
    entry = cache.lookup(SCOPE, "Hello?")
    assert entry is not None and first != second
    assert (entry.entry_id, entry.text, entry.token_ids) == (second, "new", (2,))
    assert cache.num_entries == 1


def test_entries_expire_after_ttl(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    cache = open_cache(tmp_path / "c.sqlite3", clock, evictions, ttl_s=60.0)
    try:
        cache.store(SCOPE, "a", "A", (1,), "stop")
        clock.now += 30
        cache.store(SCOPE, "b", "B", (2,), "stop")
        clock.now += 29
        assert cache.lookup(SCOPE, "a") is not None  # used now, but its age counts from storing
        clock.now += 1
        assert cache.lookup(SCOPE, "a") is None
        assert cache.lookup(SCOPE, "b") is not None
        clock.now += 30
        assert cache.purge_expired() == 1
        assert cache.num_entries == 0
        assert evictions.counts == {"ttl": 2}
    finally:
        cache.close()


def test_least_recently_used_entries_are_evicted_first(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    cache = open_cache(tmp_path / "c.sqlite3", clock, evictions, max_entries=3)
    try:
        for prompt in ("a", "b", "c"):
            cache.store(SCOPE, prompt, prompt.upper(), (1,), "stop")
            clock.now += 1
        assert cache.lookup(SCOPE, "a") is not None  # "a" is now the most recently used
        clock.now += 1
        cache.store(SCOPE, "d", "D", (1,), "stop")  # evicts "b"
        clock.now += 1
        cache.store(SCOPE, "e", "E", (1,), "stop")  # evicts "c"
        alive = {p for p in "abcde" if cache.lookup(SCOPE, p) is not None}
        assert alive == {"a", "d", "e"}
        assert cache.num_entries == 3
        assert evictions.counts == {"lru": 2}
    finally:
        cache.close()


def test_entries_survive_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "nested" / "cache.sqlite3"
    cache = open_cache(path, clock)
    entry_id = cache.store(SCOPE, "Hello?", "Hi there.", (5, 6), "length").entry_id
    cache.close()

    reopened = open_cache(path, clock)
    try:
        entry = reopened.lookup(SCOPE, "Hello?")
        assert entry is not None
        assert (entry.entry_id, entry.token_ids, entry.finish_reason) == (entry_id, (5, 6), "length")
        assert reopened.num_entries == 1
    finally:
        reopened.close()


def test_reopening_purges_entries_that_expired_meanwhile(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "cache.sqlite3"
    cache = open_cache(path, clock, ttl_s=60.0)
    cache.store(SCOPE, "Hello?", "Hi there.", (1,), "stop")
    cache.close()
    clock.now += 61
    reopened = open_cache(path, clock, ttl_s=60.0)
    try:
        assert reopened.num_entries == 0
    finally:
        reopened.close()


def test_invalidate_removes_only_that_model(cache: ExactCache) -> None:
    other = CacheScope("other@1", SCOPE.tenant, SCOPE.params)
    cache.store(SCOPE, "a", "A", (1,), "stop")
    cache.store(other, "a", "A", (1,), "stop")
    assert cache.invalidate(SCOPE.model) == 1
    assert cache.lookup(SCOPE, "a") is None
    assert cache.lookup(other, "a") is not None


@pytest.mark.parametrize(("scope", "prompt", "field"), [
    (CacheScope(""), "Hello?", "scope.model"),
    (SCOPE, "", "prompt"),
])
def test_empty_model_or_prompt_is_invalid(cache: ExactCache, scope: CacheScope, prompt: str,
                                          field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        cache.lookup(scope, prompt)
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        cache.store(scope, prompt, "text", (1,), "stop")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"finish_reason": "cancelled"}, "finish_reason"),
    ({"finish_reason": "error"}, "finish_reason"),
    ({"token_ids": (-1,)}, "token_ids"),
    ({"token_ids": (1 << 32,)}, "token_ids"),
    ({"text": "x" * 5000}, "entry"),
    ({"ttl_s": 61.0}, "ttl_s"),
    ({"ttl_s": -1.0}, "ttl_s"),
])
def test_store_refuses_what_must_not_be_cached(cache: ExactCache, kwargs: dict[str, object],
                                               field: str) -> None:
    args: dict[str, object] = {"text": "ok", "token_ids": (1,), "finish_reason": "stop"} | kwargs
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        cache.store(SCOPE, "Hello?", **args)  # type: ignore[arg-type]
    assert cache.num_entries == 0


def test_each_entry_has_its_own_ttl(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    cache = open_cache(tmp_path / "c.sqlite3", clock, evictions, ttl_s=60.0)
    try:
        cache.store(SCOPE, "short", "S", (1,), "stop", ttl_s=10.0)
        cache.store(SCOPE, "long", "L", (1,), "stop")
        clock.now += 10
        assert cache.lookup(SCOPE, "short") is None
        assert cache.lookup(SCOPE, "long") is not None
        assert evictions.counts == {"ttl": 1}
    finally:
        cache.close()


def test_streamed_deltas_are_kept(cache: ExactCache) -> None:
    cache.store(SCOPE, "Hi?", "Hello there", (1, 2, 3), "stop", deltas=((5, 1), (0, 1), (6, 1)))
    entry = cache.lookup(SCOPE, "Hi?")
    assert entry is not None and entry.deltas == ((5, 1), (0, 1), (6, 1))


def test_invalidate_by_namespace_tenant_and_entry(cache: ExactCache) -> None:
    other_tenant = CacheScope(SCOPE.model, "globex", SCOPE.params)
    kept = cache.store(SCOPE, "keep", "K", (1,), "stop")
    one = cache.store(SCOPE, "one", "O", (1,), "stop")
    cache.store(other_tenant, "a", "A", (1,), "stop")
    cache.store(other_tenant, "b", "B", (1,), "stop")
    assert cache.invalidate_entry(one.entry_id) == 1
    assert cache.invalidate_tenant("globex") == 2
    assert cache.lookup(SCOPE, "keep") is not None and cache.num_entries == 1
    assert cache.invalidate_namespace(SCOPE) == 1
    assert cache.lookup(SCOPE, "keep") is None and kept.entry_id


def test_a_new_model_version_purges_the_other_versions(cache: ExactCache) -> None:
    old = CacheScope("smollm2-135m-instruct@0.1.1", SCOPE.tenant, SCOPE.params)
    other_name = CacheScope("smollm2-135m-instruct-x@1", SCOPE.tenant, SCOPE.params)
    for scope in (old, SCOPE, other_name):
        cache.store(scope, "a", "A", (1,), "stop")
    assert cache.purge_other_versions(SCOPE.model) == 1
    assert cache.lookup(old, "a") is None
    assert cache.lookup(SCOPE, "a") is not None and cache.lookup(other_name, "a") is not None


def test_negative_feedback_removes_the_entry_after_the_limit(cache: ExactCache) -> None:
    entry = cache.store(SCOPE, "a", "A", (1,), "stop")
    assert cache.feedback(entry.entry_id, negative=False, evict_after=2) == (True, False)
    assert cache.feedback(entry.entry_id, negative=True, evict_after=2) == (True, False)
    assert cache.feedback(entry.entry_id, negative=True, evict_after=2) == (True, True)
    assert cache.feedback(entry.entry_id, negative=True, evict_after=2) == (False, False)
    assert cache.lookup(SCOPE, "a") is None


def test_shared_scope_is_an_explicit_setting(tmp_path: Path, clock: FakeClock) -> None:
    shared = ExactCache(tmp_path / "c.sqlite3", ttl_s=60, max_entries=10, max_entry_bytes=4096, clock=clock,
                        shared_across_tenants=True)
    try:
        shared.store(SCOPE, "a", "A", (1,), "stop")
        assert shared.lookup(CacheScope(SCOPE.model, "globex", SCOPE.params), "a") is not None
    finally:
        shared.close()


def test_a_file_of_the_old_schema_is_emptied_not_misread(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "c.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE entries (key BLOB PRIMARY KEY, entry_id TEXT, model TEXT)")
        conn.execute("INSERT INTO entries VALUES (x'00', 'e', 'm@1')")
    cache = open_cache(path, clock)
    try:
        assert cache.was_reset and cache.num_entries == 0
        cache.store(SCOPE, "a", "A", (1,), "stop")
        assert cache.lookup(SCOPE, "a") is not None
    finally:
        cache.close()


def test_another_embedding_model_purges_every_entry(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "c.sqlite3"
    first = ExactCache(path, ttl_s=60, max_entries=10, max_entry_bytes=4096, clock=clock, embedder_id="mini@1")
    first.store(SCOPE, "a", "A", (1,), "stop")
    first.close()
    evictions = Evictions()
    second = ExactCache(path, ttl_s=60, max_entries=10, max_entry_bytes=4096, clock=clock, embedder_id="mini@2",
                        on_remove=evictions)
    try:
        assert second.num_entries == 0 and evictions.counts == {"embedder": 1}
    finally:
        second.close()
