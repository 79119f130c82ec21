"""The cache's own MiniLM forward gives the vectors sentence-transformers gives for the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from services.cache.embedder import Embedder, model_path

ROOT = Path(__file__).resolve().parents[3]

TEXTS = [
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "Ünïcödé café naïve 東京 🙂",
    "word " * 200,  # 202 word pieces: the batch is padded to this
    "a",
    "The quick brown fox jumps over the lazy dog. " * 5,
]


def test_vectors_and_token_counts_match_sentence_transformers(embedder: Embedder) -> None:
    from sentence_transformers import SentenceTransformer  # the reference, imported by tests only

    reference = SentenceTransformer(str(model_path()), device="cpu")
    expected = reference.encode(TEXTS, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    got = np.stack([v for v in embedder.encode(TEXTS) if v is not None])
    assert got.shape == expected.shape == (len(TEXTS), embedder.dim)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # One at a time (no padding) the same vectors, up to float rounding.
    alone = np.stack([embedder.encode_one(t) for t in TEXTS])  # type: ignore[misc]
    np.testing.assert_allclose(alone, expected, atol=1e-5)
    counts = [len(reference.tokenizer(t, add_special_tokens=True, truncation=False)["input_ids"]) for t in TEXTS]
    assert [embedder.num_tokens(t) for t in TEXTS] == counts
    assert embedder.max_tokens == reference.max_seq_length == 256


def test_loading_the_embedder_imports_neither_sentence_transformers_nor_transformers() -> None:
    probe = ("import json, sys\nfrom services.cache.embedder import Embedder\nEmbedder().encode_one('hi')\n"
             "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert "torch" in loaded  # the probe did load the model
    assert loaded.isdisjoint({"sentence_transformers", "transformers", "sklearn", "scipy"})
