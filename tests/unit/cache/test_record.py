"""CacheRecord (the entries of both tiers) on a real SQLite file: replacement, TTL, LRU,
persistence, invalidation, model versions, feedback, validation, schema and embedder changes."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiserve.common.errors import InvalidArgument
from services.cache.component_config import RecordConfig
from services.cache.entry import CacheEntry, CacheScope
from services.cache.exact import ExactTier
from services.cache.record import CacheRecord
from tests.unit.cache.support import Evictions, FakeClock

SCOPE = CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="temperature=0")
LIMITS = RecordConfig(ttl_s=60.0, max_entries=100, max_entry_bytes=4096)


def open_record(path: Path, clock: FakeClock, evictions: Evictions | None = None, embedder_id: str = "",
                **limits: object) -> CacheRecord:
    return CacheRecord(path, dataclasses.replace(LIMITS, **limits), embedder_id=embedder_id,  # type: ignore[arg-type]
                       clock=clock, on_remove=evictions or Evictions())


def find(record: CacheRecord, scope: CacheScope, prompt: str) -> CacheEntry | None:
    """What the exact tier finds: the way to see whether an entry is still in the record."""
    return ExactTier(record).lookup(scope, prompt)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def record(tmp_path: Path, clock: FakeClock) -> Iterator[CacheRecord]:
    record = open_record(tmp_path / "cache.sqlite3", clock)
    try:
        yield record
    finally:
        record.close()


def test_store_returns_the_entry_it_wrote(record: CacheRecord, clock: FakeClock) -> None:
    entry = record.store(SCOPE, "Hello?", "Hi there.", (12, 7, 0, 4294967295), "stop", query="Hello")
    assert (entry.text, entry.token_ids, entry.finish_reason, entry.query) == (
        "Hi there.", (12, 7, 0, 4294967295), "stop", "Hello")
    assert entry.deltas == ((9, 4),)  # stored whole: one delta
    assert (entry.created_at, entry.expires_at) == (clock.now, clock.now + 60.0)
    assert find(record, SCOPE, "Hello?") == entry
    assert record.num_entries == 1


def test_store_replaces_the_entry_of_the_same_key(record: CacheRecord) -> None:
    first = record.store(SCOPE, "Hello?", "old", (1,), "length").entry_id
    second = record.store(SCOPE, "Hello?", "new", (2,), "stop").entry_id
    entry = find(record, SCOPE, "Hello?")
    assert entry is not None and first != second
    assert (entry.entry_id, entry.text, entry.token_ids) == (second, "new", (2,))
    assert record.num_entries == 1


def test_entries_expire_after_ttl(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    record = open_record(tmp_path / "c.sqlite3", clock, evictions, ttl_s=60.0)
    try:
        record.store(SCOPE, "a", "A", (1,), "stop")
        clock.now += 30
        record.store(SCOPE, "b", "B", (2,), "stop")
        clock.now += 29
        assert find(record, SCOPE, "a") is not None  # used now, but its age counts from storing
        clock.now += 1
        assert find(record, SCOPE, "a") is None
        assert find(record, SCOPE, "b") is not None
        clock.now += 30
        assert record.purge_expired() == 1
        assert record.num_entries == 0
        assert evictions.counts == {"ttl": 2}
    finally:
        record.close()


def test_least_recently_used_entries_are_evicted_first(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    record = open_record(tmp_path / "c.sqlite3", clock, evictions, max_entries=3)
    try:
        for prompt in ("a", "b", "c"):
            record.store(SCOPE, prompt, prompt.upper(), (1,), "stop")
            clock.now += 1
        assert find(record, SCOPE, "a") is not None  # "a" is now the most recently used
        clock.now += 1
        record.store(SCOPE, "d", "D", (1,), "stop")  # evicts "b"
        clock.now += 1
        record.store(SCOPE, "e", "E", (1,), "stop")  # evicts "c"
        alive = {p for p in "abcde" if find(record, SCOPE, p) is not None}
        assert alive == {"a", "d", "e"}
        assert record.num_entries == 3
        assert evictions.counts == {"lru": 2}
    finally:
        record.close()


def test_entries_survive_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "nested" / "cache.sqlite3"
    record = open_record(path, clock)
    entry_id = record.store(SCOPE, "Hello?", "Hi there.", (5, 6), "length").entry_id
    record.close()

    reopened = open_record(path, clock)
    try:
        entry = find(reopened, SCOPE, "Hello?")
        assert entry is not None
        assert (entry.entry_id, entry.token_ids, entry.finish_reason) == (entry_id, (5, 6), "length")
        assert reopened.num_entries == 1
    finally:
        reopened.close()


def test_reopening_purges_entries_that_expired_meanwhile(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "cache.sqlite3"
    record = open_record(path, clock, ttl_s=60.0)
    record.store(SCOPE, "Hello?", "Hi there.", (1,), "stop")
    record.close()
    clock.now += 61
    evictions = Evictions()
    reopened = open_record(path, clock, evictions, ttl_s=60.0)
    try:
        assert reopened.num_entries == 0 and evictions.counts == {"ttl": 1}
    finally:
        reopened.close()


def test_invalidate_removes_only_that_model(record: CacheRecord) -> None:
    other = CacheScope("other@1", SCOPE.tenant, SCOPE.params)
    record.store(SCOPE, "a", "A", (1,), "stop")
    record.store(other, "a", "A", (1,), "stop")
    assert record.invalidate(SCOPE.model) == 1
    assert find(record, SCOPE, "a") is None
    assert find(record, other, "a") is not None


@pytest.mark.parametrize(("scope", "prompt", "kwargs", "field"), [
    (CacheScope(""), "Hello?", {}, "scope.model"),
    (SCOPE, "", {}, "prompt"),
    (SCOPE, "Hello?", {"finish_reason": "cancelled"}, "finish_reason"),
    (SCOPE, "Hello?", {"finish_reason": "error"}, "finish_reason"),
    (SCOPE, "Hello?", {"token_ids": (-1,)}, "token_ids"),
    (SCOPE, "Hello?", {"token_ids": (1 << 32,)}, "token_ids"),
    (SCOPE, "Hello?", {"deltas": ((-1, 1),)}, "deltas"),
    (SCOPE, "Hello?", {"text": "x" * 5000}, "entry"),
    (SCOPE, "Hello?", {"ttl_s": 61.0}, "ttl_s"),
    (SCOPE, "Hello?", {"ttl_s": -1.0}, "ttl_s"),
])
def test_store_refuses_what_must_not_be_cached(record: CacheRecord, scope: CacheScope, prompt: str,
                                               kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"text": "ok", "token_ids": (1,), "finish_reason": "stop"} | kwargs
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        record.store(scope, prompt, **args)  # type: ignore[arg-type]
    assert record.num_entries == 0


def test_each_entry_has_its_own_ttl(tmp_path: Path, clock: FakeClock) -> None:
    evictions = Evictions()
    record = open_record(tmp_path / "c.sqlite3", clock, evictions, ttl_s=60.0)
    try:
        record.store(SCOPE, "short", "S", (1,), "stop", ttl_s=10.0)
        record.store(SCOPE, "long", "L", (1,), "stop")
        clock.now += 10
        assert find(record, SCOPE, "short") is None
        assert find(record, SCOPE, "long") is not None
        assert evictions.counts == {"ttl": 1}
    finally:
        record.close()


def test_streamed_deltas_are_kept(record: CacheRecord) -> None:
    record.store(SCOPE, "Hi?", "Hello there", (1, 2, 3), "stop", deltas=((5, 1), (0, 1), (6, 1)))
    entry = find(record, SCOPE, "Hi?")
    assert entry is not None and entry.deltas == ((5, 1), (0, 1), (6, 1))


def test_invalidate_by_namespace_tenant_and_entry(record: CacheRecord) -> None:
    other_tenant = CacheScope(SCOPE.model, "globex", SCOPE.params)
    record.store(SCOPE, "keep", "K", (1,), "stop")
    one = record.store(SCOPE, "one", "O", (1,), "stop")
    record.store(other_tenant, "a", "A", (1,), "stop")
    record.store(other_tenant, "b", "B", (1,), "stop")
    assert record.invalidate_entry(one.entry_id) == 1
    assert find(record, SCOPE, "one") is None
    assert record.invalidate_tenant("globex") == 2
    assert find(record, SCOPE, "keep") is not None and record.num_entries == 1
    assert record.invalidate_namespace(SCOPE) == 1
    assert find(record, SCOPE, "keep") is None and record.num_entries == 0


def test_a_new_model_version_purges_the_other_versions(record: CacheRecord) -> None:
    old = CacheScope("smollm2-135m-instruct@0.1.1", SCOPE.tenant, SCOPE.params)
    other_name = CacheScope("smollm2-135m-instruct-x@1", SCOPE.tenant, SCOPE.params)
    for scope in (old, SCOPE, other_name):
        record.store(scope, "a", "A", (1,), "stop")
    assert record.purge_other_versions(SCOPE.model) == 1
    assert find(record, old, "a") is None
    assert find(record, SCOPE, "a") is not None and find(record, other_name, "a") is not None


@pytest.mark.parametrize("purge", [True, False])
def test_noting_a_new_version_purges_only_when_the_setting_says_so(tmp_path: Path, clock: FakeClock,
                                                                  purge: bool) -> None:
    evictions = Evictions()
    record = open_record(tmp_path / "c.sqlite3", clock, evictions, purge_old_versions=purge)
    old = CacheScope("smollm2-135m-instruct@0.1.1", SCOPE.tenant, SCOPE.params)
    try:
        assert record.note_model(old.model) == 0
        record.store(old, "a", "A", (1,), "stop")
        assert record.note_model(old.model) == 0  # the same version again: nothing to purge
        assert record.note_model(SCOPE.model) == (1 if purge else 0)
        assert (find(record, old, "a") is None) == purge
        assert evictions.counts == ({"model_version": 1} if purge else {})
    finally:
        record.close()


def test_negative_feedback_removes_the_entry_after_the_limit(tmp_path: Path, clock: FakeClock) -> None:
    record = open_record(tmp_path / "c.sqlite3", clock, feedback_evict_after=2)
    try:
        entry = record.store(SCOPE, "a", "A", (1,), "stop")
        assert record.feedback(entry.entry_id, negative=False) == (True, False)
        assert record.feedback(entry.entry_id, negative=True) == (True, False)
        assert record.feedback(entry.entry_id, negative=True) == (True, True)
        assert record.feedback(entry.entry_id, negative=True) == (False, False)
        assert find(record, SCOPE, "a") is None
    finally:
        record.close()


def test_feedback_evict_after_zero_only_counts(tmp_path: Path, clock: FakeClock) -> None:
    record = open_record(tmp_path / "c.sqlite3", clock, feedback_evict_after=0)
    try:
        entry = record.store(SCOPE, "a", "A", (1,), "stop")
        for _ in range(3):
            assert record.feedback(entry.entry_id, negative=True) == (True, False)
        assert find(record, SCOPE, "a") is not None
    finally:
        record.close()


def test_shared_scope_is_an_explicit_setting(tmp_path: Path, clock: FakeClock) -> None:
    shared = open_record(tmp_path / "c.sqlite3", clock, shared_across_tenants=True)
    try:
        shared.store(SCOPE, "a", "A", (1,), "stop")
        assert find(shared, CacheScope(SCOPE.model, "globex", SCOPE.params), "a") is not None
    finally:
        shared.close()


def test_a_file_of_the_old_schema_is_emptied_not_misread(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "c.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE entries (key BLOB PRIMARY KEY, entry_id TEXT, model TEXT)")
        conn.execute("INSERT INTO entries VALUES (x'00', 'e', 'm@1')")
    record = open_record(path, clock)
    try:
        assert record.was_reset and record.num_entries == 0
        record.store(SCOPE, "a", "A", (1,), "stop")
        assert find(record, SCOPE, "a") is not None
    finally:
        record.close()


def test_another_embedding_model_purges_every_entry(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "c.sqlite3"
    first = open_record(path, clock, embedder_id="mini@1")
    first.store(SCOPE, "a", "A", (1,), "stop")
    first.close()
    evictions = Evictions()
    second = open_record(path, clock, evictions, embedder_id="mini@2")
    try:
        assert second.num_entries == 0 and evictions.counts == {"embedder": 1}
    finally:
        second.close()


def test_vectors_and_fingerprint_cover_only_entries_with_an_embedding(record: CacheRecord) -> None:
    with_vector = record.store(SCOPE, "a", "A", (1,), "stop", query="a", embedding=b"\0" * 8)
    record.store(SCOPE, "b", "B", (1,), "stop")  # exact tier only
    assert [(i, blob) for batch in record.vectors() for i, _, blob in batch] == [(with_vector.id, b"\0" * 8)]
    assert record.fingerprint() == (1, with_vector.id, with_vector.id)
