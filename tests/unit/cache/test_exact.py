"""ExactTier over a real CacheRecord: the same namespace and prompt hit, anything else misses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aiserve.common.errors import InvalidArgument
from services.cache.component_config import RecordConfig
from services.cache.entry import CacheScope
from services.cache.exact import ExactTier
from services.cache.record import CacheRecord
from tests.unit.cache.support import Evictions, FakeClock

SCOPE = CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="temperature=0")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def evictions() -> Evictions:
    return Evictions()


@pytest.fixture
def record(tmp_path: Path, clock: FakeClock, evictions: Evictions) -> Iterator[CacheRecord]:
    record = CacheRecord(tmp_path / "cache.sqlite3", RecordConfig(ttl_s=60.0), clock=clock, on_remove=evictions)
    try:
        yield record
    finally:
        record.close()


def test_the_same_scope_and_prompt_hit_with_the_stored_answer(record: CacheRecord) -> None:
    entry_id = record.store(SCOPE, "Hello?", "Hi there.", (12, 7), "stop").entry_id
    entry = ExactTier(record).lookup(SCOPE, "Hello?")
    assert entry is not None
    assert (entry.entry_id, entry.text, entry.token_ids, entry.finish_reason) == (entry_id, "Hi there.", (12, 7),
                                                                                  "stop")
    assert ExactTier(record).lookup(SCOPE, "Hello") is None


@pytest.mark.parametrize("other", [
    CacheScope(SCOPE.model, "globex", SCOPE.params),
    CacheScope("smollm2-135m-instruct@0.1.3", SCOPE.tenant, SCOPE.params),
    CacheScope(SCOPE.model, SCOPE.tenant, "temperature=0.7"),
    CacheScope(SCOPE.model, "", SCOPE.params),
    CacheScope(SCOPE.model, SCOPE.tenant, SCOPE.params, context='[["system","Answer in French."]]'),
])
def test_other_scope_never_hits(record: CacheRecord, other: CacheScope) -> None:
    record.store(SCOPE, "Hello?", "Hi there.", (1, 2), "stop")
    assert ExactTier(record).lookup(other, "Hello?") is None
    assert ExactTier(record).lookup(SCOPE, "Hello?") is not None


def test_key_parts_cannot_bleed_into_each_other(record: CacheRecord) -> None:
    record.store(CacheScope("m@1", "ab", "c"), "p", "answer", (1,), "stop")
    assert ExactTier(record).lookup(CacheScope("m@1", "a", "bc"), "p") is None
    assert ExactTier(record).lookup(CacheScope("m@1", "ab", "c"), "p") is not None


def test_an_expired_entry_is_not_returned_and_is_deleted(record: CacheRecord, clock: FakeClock,
                                                         evictions: Evictions) -> None:
    record.store(SCOPE, "Hello?", "Hi there.", (1,), "stop")
    clock.now += 60
    assert ExactTier(record).lookup(SCOPE, "Hello?") is None
    assert record.num_entries == 0 and evictions.counts == {"ttl": 1}


@pytest.mark.parametrize(("scope", "prompt", "field"), [
    (CacheScope(""), "Hello?", "scope.model"),
    (SCOPE, "", "prompt"),
])
def test_empty_model_or_prompt_is_invalid(record: CacheRecord, scope: CacheScope, prompt: str, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}:"):
        ExactTier(record).lookup(scope, prompt)
