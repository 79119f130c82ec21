"""VectorIndex on real faiss: namespaces, removal, flat and HNSW, snapshots that are refused."""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt
import pytest

from aiserve.common.config import ConfigError
from services.cache.component_config import IndexParams
from services.cache.index import VectorIndex

DIM = 16
NS_A, NS_B = b"a" * 32, b"b" * 32


def unit(rng: np.random.Generator, n: int) -> npt.NDArray[np.float32]:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(params=["flat", "hnsw"])
def index(request: pytest.FixtureRequest) -> VectorIndex:
    return VectorIndex(DIM, IndexParams(index_kind=request.param))


def test_search_finds_the_vector_itself_with_similarity_one(index: VectorIndex) -> None:
    vectors = unit(np.random.default_rng(0), 50)
    index.add(NS_A, np.arange(1, 51, dtype=np.int64), vectors)
    found = index.search(NS_A, vectors[7], 3)
    assert found[0][0] == 8 and found[0][1] == pytest.approx(1.0, abs=1e-5)
    assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)


def test_a_namespace_never_sees_another_namespaces_vectors(index: VectorIndex) -> None:
    vectors = unit(np.random.default_rng(1), 2)
    index.add(NS_A, np.array([1], np.int64), vectors[:1])
    index.add(NS_B, np.array([2], np.int64), vectors[1:])
    assert [i for i, _ in index.search(NS_B, vectors[0], 5)] == [2]
    assert index.search(b"c" * 32, vectors[0], 5) == []


def test_removed_ids_are_never_returned(index: VectorIndex) -> None:
    vectors = unit(np.random.default_rng(2), 40)
    index.add(NS_A, np.arange(1, 41, dtype=np.int64), vectors)
    index.remove(range(1, 31))  # past a quarter: the HNSW namespace is compacted
    index.remove([999])  # unknown: ignored
    found = index.search(NS_A, vectors[0], 40)
    assert {i for i, _ in found} == set(range(31, 41))
    assert len(index) == 10 and index.fingerprint() == (10, sum(range(31, 41)), 40)


def test_snapshot_round_trip_and_refusals(index: VectorIndex, tmp_path: Path) -> None:
    vectors = unit(np.random.default_rng(3), 20)
    index.add(NS_A, np.arange(1, 11, dtype=np.int64), vectors[:10])
    index.add(NS_B, np.arange(11, 21, dtype=np.int64), vectors[10:])
    index.remove([3])
    path = tmp_path / "index.faiss"
    index.save(path)
    fingerprint = index.fingerprint()

    loaded = VectorIndex(DIM, index.params)
    assert loaded.load(path, fingerprint) is None
    assert loaded.search(NS_B, vectors[12], 1)[0][0] == 13
    assert 3 not in {i for i, _ in loaded.search(NS_A, vectors[2], 10)}

    assert VectorIndex(DIM, index.params).load(tmp_path / "missing.faiss", fingerprint) == "missing"
    assert VectorIndex(DIM, index.params).load(path, (1, 2, 3)) == "stale"
    other = "hnsw" if index.params.index_kind == "flat" else "flat"
    assert VectorIndex(DIM, IndexParams(index_kind=other)).load(path, fingerprint) == "other_settings"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert VectorIndex(DIM, index.params).load(path, fingerprint) == "corrupt"
    path.write_bytes(b"not an index")
    assert VectorIndex(DIM, index.params).load(path, fingerprint) == "corrupt"


def test_an_unknown_index_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="^index_kind:"):
        VectorIndex(DIM, IndexParams(index_kind="ivf"))


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_a_build_runs_on_its_threads_and_searches_go_back_to_theirs(threads: int) -> None:
    index = VectorIndex(DIM, IndexParams(index_kind="hnsw", index_build_threads=threads))
    faiss.omp_set_num_threads(1)
    seen = []
    with index.building():
        seen.append(faiss.omp_get_max_threads())
        index.add(b"ns", np.arange(4, dtype=np.int64), unit(np.random.default_rng(0), 4))
    assert seen == [threads or len(os.sched_getaffinity(0))]
    assert faiss.omp_get_max_threads() == 1
    assert len(index) == 4
