"""SemanticCache on real SQLite and real faiss, with synthetic vectors of known similarity:
tiers, threshold, namespaces, lifecycle (TTL, LRU, model versions, invalidation, feedback) and
what survives a restart."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from aiserve.common.errors import InvalidArgument
from services.cache.component_config import IndexParams, MatchRule, RecordConfig
from services.cache.entry import CacheScope
from services.cache.semantic import SemanticCache
from tests.unit.cache.support import Evictions, FakeClock

DIM = 16
SCOPE = CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="t=0")
RULE = MatchRule(similarity_threshold=0.88)
LIMITS = RecordConfig(ttl_s=60.0, max_entries=100, max_entry_bytes=4096)
Q1, Q2 = "What is the capital of France?", "Which city is the capital of France?"

_E0, _E1 = np.eye(DIM, dtype=np.float32)[0], np.eye(DIM, dtype=np.float32)[1]


def at(similarity: float) -> npt.NDArray[np.float32]:
    """A unit vector whose cosine similarity to BASE is ``similarity``."""
    return (similarity * _E0 + np.sqrt(1 - similarity**2) * _E1).astype(np.float32)


BASE = at(1.0)


class Opened:
    def __init__(self, tmp_path: Path, clock: FakeClock) -> None:
        self.tmp_path, self.clock, self.evictions = tmp_path, clock, Evictions()

    def __call__(self, rule: MatchRule = RULE, index: IndexParams | None = None, **limits: object) -> SemanticCache:
        """A SemanticCache on the test's files; ``limits`` override RecordConfig fields."""
        return SemanticCache(self.tmp_path / "c.sqlite3", self.tmp_path / "c.faiss", dim=DIM,
                             record=dataclasses.replace(LIMITS, **limits), rule=rule,  # type: ignore[arg-type]
                             index=index or IndexParams(), embedder_id="mini@test", clock=self.clock,
                             on_remove=self.evictions)


@pytest.fixture
def open_(tmp_path: Path) -> Opened:
    return Opened(tmp_path, FakeClock())


@pytest.fixture
def cache(open_: Opened) -> Iterator[SemanticCache]:
    cache = open_()
    try:
        yield cache
    finally:
        cache.close()


def store(cache: SemanticCache, query: str = Q1, vector: npt.NDArray[np.float32] = BASE,
          scope: CacheScope = SCOPE, **kwargs: object) -> str:
    return cache.store(scope, f"<user>{query}", "Paris.", (1, 2), "stop", query=query, vector=vector,
                       **kwargs).entry_id  # type: ignore[arg-type]


def lookup(cache: SemanticCache, query: str = Q2, vector: npt.NDArray[np.float32] = BASE,
           scope: CacheScope = SCOPE, min_similarity: float | None = None) -> float | None:
    hit = cache.lookup(scope, f"<user>{query}", query, vector, min_similarity)
    return None if hit is None else hit.similarity


def test_exact_tier_first_then_semantic_at_or_over_the_threshold(cache: SemanticCache) -> None:
    store(cache)
    exact = cache.lookup(SCOPE, f"<user>{Q1}", Q1, at(0.5))
    assert exact is not None and exact.tier == "exact" and exact.similarity == 1.0
    assert lookup(cache, vector=at(0.95)) == pytest.approx(0.95, abs=1e-5)
    assert lookup(cache, vector=at(0.8801)) == pytest.approx(0.8801, abs=1e-4)
    assert lookup(cache, vector=at(0.87)) is None


def test_a_request_can_only_make_the_threshold_stricter(cache: SemanticCache) -> None:
    store(cache)
    assert lookup(cache, vector=at(0.95), min_similarity=0.97) is None
    assert lookup(cache, vector=at(0.98), min_similarity=0.97) is not None
    assert lookup(cache, vector=at(0.87), min_similarity=0.5) is None  # 0.5 is looser: the default holds
    with pytest.raises(InvalidArgument, match="^min_similarity:"):
        lookup(cache, min_similarity=1.5)


def test_the_key_term_guard_refuses_a_near_vector_with_another_fact(open_: Opened) -> None:
    guarded = open_()
    store(guarded)
    assert lookup(guarded, "What is the capital of Germany?", at(0.99)) is None
    guarded.close()
    unguarded = open_(rule=MatchRule(similarity_threshold=0.88, key_term_guard=False))
    try:
        assert lookup(unguarded, "What is the capital of Germany?", at(0.99)) is not None
    finally:
        unguarded.close()


def test_the_best_agreeing_candidate_answers(cache: SemanticCache) -> None:
    store(cache, "What is the capital of Germany?", at(0.99))
    store(cache, Q1, at(0.95))
    hit = cache.lookup(SCOPE, "<user>new", Q2, BASE)
    assert hit is not None and hit.entry.query == Q1


@pytest.mark.parametrize("other", [
    CacheScope(SCOPE.model, "globex", SCOPE.params),
    CacheScope("smollm2-135m-instruct-b@1", SCOPE.tenant, SCOPE.params),
    CacheScope(SCOPE.model, SCOPE.tenant, "t=0.7"),
    CacheScope(SCOPE.model, SCOPE.tenant, SCOPE.params, context='[["system","Be brief."]]'),
])
def test_no_hit_across_namespaces(cache: SemanticCache, other: CacheScope) -> None:
    store(cache)
    assert lookup(cache, scope=other) is None
    assert lookup(cache, Q1, scope=other) is None


def test_tenants_share_only_when_the_setting_says_so(open_: Opened) -> None:
    shared = open_(shared_across_tenants=True)
    try:
        store(shared)
        assert lookup(shared, scope=CacheScope(SCOPE.model, "globex", SCOPE.params)) is not None
    finally:
        shared.close()


def test_ttl_and_lru_remove_the_vector_too(open_: Opened) -> None:
    cache = open_(max_entries=2)
    try:
        store(cache, "q1", at(0.99), ttl_s=10.0)
        open_.clock.now += 10
        assert lookup(cache, "q1 again", at(0.99)) is None  # expired
        store(cache, "a", at(0.2))
        open_.clock.now += 1
        store(cache, "b", at(0.3))
        open_.clock.now += 1
        store(cache, "c", at(0.4))  # evicts "a", the least recently used
        assert open_.evictions.counts == {"ttl": 1, "lru": 1}
        assert cache.num_entries == cache.num_vectors == 2
    finally:
        cache.close()


def test_a_new_model_version_makes_old_entries_unreachable_and_purges_them(cache: SemanticCache) -> None:
    old = CacheScope("smollm2-135m-instruct@0.1.1", SCOPE.tenant, SCOPE.params)
    store(cache, scope=old)
    assert lookup(cache, scope=old) is not None
    assert lookup(cache, scope=SCOPE) is None  # unreachable: the version is in the namespace
    assert cache.num_entries == cache.num_vectors == 0  # ... and purged


def test_invalidate_and_feedback_remove_entries(cache: SemanticCache) -> None:
    entry_id = store(cache)
    store(cache, "other", at(0.1))
    assert cache.feedback(entry_id, negative=True) == (True, True)
    assert lookup(cache) is None
    assert cache.invalidate(scope=SCOPE) == 1
    assert cache.num_vectors == 0
    with pytest.raises(InvalidArgument, match="^target:"):
        cache.invalidate()


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
@pytest.mark.parametrize("damage", ["none", "missing", "corrupt", "stale"])
def test_entries_and_index_survive_a_restart(open_: Opened, kind: str, damage: str) -> None:
    params = IndexParams(index_kind=kind)
    cache = open_(index=params)
    store(cache)
    store(cache, "gone", at(0.3))
    cache.invalidate(entry_id=store(cache, "also gone", at(0.2)))
    cache.close()
    index_file = open_.tmp_path / "c.faiss"
    if damage == "missing":
        index_file.unlink()
    elif damage == "corrupt":
        index_file.write_bytes(index_file.read_bytes()[:-10])
    elif damage == "stale":  # the record moved on after the snapshot (a crash)
        stale = open_(index=params)
        stale.snapshot()
        store(stale, "late", at(0.4))
        stale.record.close()
    reopened = open_(index=params)
    try:
        assert reopened.index_source == ("snapshot" if damage == "none" else f"rebuilt ({damage})")
        assert lookup(reopened, vector=at(0.95)) == pytest.approx(0.95, abs=1e-5)
        assert reopened.num_vectors == reopened.num_entries
    finally:
        reopened.close()


def test_the_matching_logic_imports_neither_grpc_nor_torch() -> None:
    """SemanticCache, the record and the tiers are core code: grpc stays in server.py, torch
    in the embedding model (loaded by the service, not by the match rule). The settings import
    neither faiss nor numpy."""
    core = ("import sys; import services.cache.semantic, services.cache.exact, services.cache.record; "
            "print(sorted(m for m in ('grpc', 'torch') if m in sys.modules))")
    settings = ("import sys; import services.cache.config; "
                "print(sorted(m for m in ('grpc', 'torch', 'faiss', 'numpy') if m in sys.modules))")
    for program in (core, settings):
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                              check=True, cwd=Path(__file__).resolve().parents[3])
        assert done.stdout.strip() == "[]", (program, done.stdout, done.stderr)
