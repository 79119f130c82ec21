"""The vector index of the semantic tier: one faiss index per namespace.

A namespace's vectors live in their own index, so a search can only ever return entries of the
caller's namespace (tenant isolation is structural, not a filter after the fact). Vectors are
unit length and the metric is inner product, so scores are cosine similarities.

- ``flat`` (default): exact search (IndexFlatIP); removal is immediate.
- ``hnsw``: approximate search (IndexHNSWFlat) for large caches; faiss cannot remove from it,
  so removed ids are skipped at search time and a namespace is rebuilt once a quarter of it
  is dead.

``save``/``load`` keep a snapshot next to the SQLite file. The snapshot records the
fingerprint of the record it was taken from and a sha256 of its payload: a missing, corrupt
or stale snapshot is refused, and the caller rebuilds from SQLite (the record).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import faiss
import numpy as np
import numpy.typing as npt

from services.cache.component_config import IndexParams

_MAGIC = b"AISVIDX1"
_REBUILD_DEAD_FRACTION = 0.25


@dataclass(slots=True)
class _Space:
    index: faiss.IndexIDMap2
    dead: set[int] = field(default_factory=set)  # hnsw only: removed ids still in the graph


class VectorIndex:
    """Namespace -> faiss index of (id, unit vector). Not thread-safe: the caller holds a lock."""

    def __init__(self, dim: int, params: IndexParams | None = None) -> None:
        self.dim, self.params = dim, params or IndexParams()
        self.params.validate()
        self._spaces: dict[bytes, _Space] = {}
        self._where: dict[int, bytes] = {}  # id -> namespace, for removal

    def __len__(self) -> int:
        return len(self._where)

    @contextmanager
    def building(self) -> Iterator[None]:
        """faiss on ``params.index_build_threads`` OpenMP threads (0: every CPU this process may
        use) while inside, then back to what it was: HNSW inserts a batch in parallel, searches
        are fastest on one thread (docs/cache.md)."""
        before = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(self.params.index_build_threads or len(os.sched_getaffinity(0)))
        try:
            yield
        finally:
            faiss.omp_set_num_threads(before)

    def _new_index(self) -> faiss.IndexIDMap2:
        inner: faiss.Index
        if self.params.index_kind == "hnsw":
            inner = hnsw = faiss.IndexHNSWFlat(self.dim, self.params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efConstruction = self.params.hnsw_ef_construction
            hnsw.hnsw.efSearch = self.params.hnsw_ef_search
        else:
            inner = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(inner)

    def add(self, namespace: bytes, ids: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None:
        """Add vectors ([n, dim] float32, unit length) under ``ids`` ([n] int64)."""
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = _Space(self._new_index())
        space.index.add_with_ids(np.ascontiguousarray(vectors, np.float32), np.ascontiguousarray(ids, np.int64))
        for id_ in ids.tolist():
            self._where[id_] = namespace

    def remove(self, ids: Iterable[int]) -> None:
        """Remove ``ids``; unknown ids are ignored."""
        by_space: dict[bytes, list[int]] = {}
        for id_ in ids:
            if (namespace := self._where.pop(id_, None)) is not None:
                by_space.setdefault(namespace, []).append(id_)
        for namespace, gone in by_space.items():
            space = self._spaces[namespace]
            if self.params.index_kind == "flat":
                space.index.remove_ids(np.asarray(gone, np.int64))  # type: ignore[arg-type] # faiss wraps arrays
            else:
                space.dead.update(gone)
            live = space.index.ntotal - len(space.dead)
            if live == 0:
                del self._spaces[namespace]
            elif len(space.dead) > _REBUILD_DEAD_FRACTION * space.index.ntotal:
                self._compact(space)

    def _compact(self, space: _Space) -> None:
        ids = faiss.vector_to_array(space.index.id_map).astype(np.int64)
        vectors = space.index.index.reconstruct_n(0, space.index.ntotal)
        keep = ~np.isin(ids, np.fromiter(space.dead, np.int64, len(space.dead)))
        space.index, space.dead = self._new_index(), set()
        space.index.add_with_ids(np.ascontiguousarray(vectors[keep]), ids[keep])

    def search(self, namespace: bytes, vector: npt.NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        """The ``k`` nearest live (id, similarity) of ``namespace``, most similar first."""
        space = self._spaces.get(namespace)
        if space is None:
            return []
        want = min(k + len(space.dead), space.index.ntotal)
        scores, ids = space.index.search(vector.reshape(1, -1).astype(np.float32, copy=False), want)
        found = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True)
                 if i >= 0 and int(i) not in space.dead]
        return found[:k]

    def fingerprint(self) -> tuple[int, int, int]:
        """(count, sum, max) of the ids held: compared with the record's (CacheRecord.fingerprint)."""
        if not self._where:
            return 0, 0, 0
        return len(self._where), sum(self._where), max(self._where)

    def save(self, path: Path) -> None:
        """Write a snapshot atomically (temporary file, fsync, rename)."""
        parts, spaces = [], []
        for namespace, space in self._spaces.items():
            blob = faiss.serialize_index(space.index).tobytes()
            parts.append(blob)
            spaces.append({"namespace": namespace.hex(), "bytes": len(blob), "dead": sorted(space.dead)})
        payload = b"".join(parts)
        header = json.dumps({
            "dim": self.dim, "params": [self.params.index_kind, self.params.hnsw_m, self.params.hnsw_ef_construction],
            "fingerprint": list(self.fingerprint()), "spaces": spaces,
            "sha256": hashlib.sha256(payload).hexdigest(),
        }).encode()
        tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path, expected: tuple[int, int, int]) -> str | None:
        """Replace the contents with the snapshot at ``path`` if it is intact and matches the
        record's fingerprint ``expected``; returns None on success, else why it was refused."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "missing"
        try:
            if data[:8] != _MAGIC:
                return "corrupt"
            (size,) = struct.unpack("<Q", data[8:16])
            header = json.loads(data[16:16 + size])
            payload = memoryview(data)[16 + size:]
            if hashlib.sha256(payload).hexdigest() != header["sha256"]:
                return "corrupt"
            wanted = [self.params.index_kind, self.params.hnsw_m, self.params.hnsw_ef_construction]
            if header["dim"] != self.dim or header["params"] != wanted:
                return "other_settings"
            if tuple(header["fingerprint"]) != tuple(expected):
                return "stale"
            spaces, where, offset = {}, {}, 0
            for item in header["spaces"]:
                blob = np.frombuffer(payload[offset:offset + item["bytes"]], np.uint8)
                offset += item["bytes"]
                index = cast(faiss.IndexIDMap2, faiss.deserialize_index(blob))
                if self.params.index_kind == "hnsw":
                    cast(faiss.IndexHNSWFlat, faiss.downcast_index(index.index)).hnsw.efSearch = \
                        self.params.hnsw_ef_search
                namespace, dead = bytes.fromhex(item["namespace"]), set(item["dead"])
                spaces[namespace] = _Space(index, dead)
                for id_ in faiss.vector_to_array(index.id_map).tolist():
                    if id_ not in dead:
                        where[int(id_)] = namespace
        except (ValueError, KeyError, TypeError, RuntimeError, struct.error):
            return "corrupt"
        self._spaces, self._where = spaces, where
        if self.fingerprint() != tuple(expected):
            self._spaces, self._where = {}, {}
            return "stale"
        return None

    def clear(self) -> None:
        self._spaces, self._where = {}, {}
