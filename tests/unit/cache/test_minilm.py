"""The cache's own MiniLM forward gives the vectors sentence-transformers gives for the model
(float32), and within 0.003 of them in cosine with bf16 products, changing no decision of the
calibration set; "auto" picks bf16 only where the CPU has bf16 instructions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiserve.common.cpu import read_cpu_flags
from services.cache.calibrate import load_pairs, score_pairs
from services.cache.component_config import DEFAULT_SIMILARITY_THRESHOLD
from services.cache.embedder import Embedder, model_path
from services.cache.precision import choose_dtype

ROOT = Path(__file__).resolve().parents[3]

TEXTS = [
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "Ünïcödé café naïve 東京 🙂",
    "word " * 200,  # 202 word pieces: the batch is padded to this
    "a",
    "The quick brown fox jumps over the lazy dog. " * 5,
]


@pytest.fixture(scope="module")
def float32() -> Embedder:
    return Embedder(threads=1, dtype="float32")


@pytest.fixture(scope="module")
def bfloat16() -> Embedder:
    return Embedder(threads=1, dtype="bfloat16")


def test_vectors_and_token_counts_match_sentence_transformers(float32: Embedder) -> None:
    from sentence_transformers import SentenceTransformer  # the reference, imported by tests only

    embedder = float32

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


@pytest.mark.parametrize(("device", "flags", "dtype"), [
    ("cpu", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "bfloat16"),  # Sapphire Rapids
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # Zen 4, Cooper Lake
    ("cpu", {"avx2", "avx512f"}, "float32"),  # Skylake-SP: bf16 would be emulated
    ("cpu", {"avx2"}, "float32"),
    ("cpu", set(), "float32"),  # ARM, or no /proc/cpuinfo
    ("cuda", {"avx2", "avx512_bf16"}, "float32"),  # not measured on a GPU
])
def test_auto_picks_bf16_only_where_the_cpu_has_bf16_instructions(device: str, flags: set[str], dtype: str) -> None:
    chosen, why = choose_dtype(device, frozenset(flags), "auto")
    assert chosen == dtype and why
    for setting in ("float32", "bfloat16"):  # a setting wins on every machine
        assert choose_dtype(device, frozenset(flags), setting) == (setting, f"embedding_dtype={setting} set")


def test_bf16_vectors_are_within_0_003_of_float32_and_change_no_calibration_decision(
        float32: Embedder, bfloat16: Embedder) -> None:
    assert bfloat16.dtype == "bfloat16" and float32.dtype == "float32" and bfloat16.model_id == float32.model_id
    if {"avx512_bf16", "amx_bf16"} & read_cpu_flags():
        assert bfloat16.packed  # the products run on oneDNN-packed weights
    assert float32.packed  # oneDNN's float32 products on packed weights, on every CPU
    wide, narrow = score_pairs(load_pairs(), float32), score_pairs(load_pairs(), bfloat16)
    drift = max(abs(n.similarity - w.similarity) for n, w in zip(narrow, wide, strict=True))
    assert 0 < drift <= 0.003, drift  # not 0: the products did run in bf16
    threshold = DEFAULT_SIMILARITY_THRESHOLD
    flipped = [(w.a, w.b) for n, w in zip(narrow, wide, strict=True)
               if (n.similarity >= threshold) != (w.similarity >= threshold)]
    assert not flipped, flipped
    texts = sorted({w.a for w in wide})[:20]
    batched = bfloat16.encode(texts)
    alone = [float(b @ a) for b, t in zip(batched, texts, strict=True)  # type: ignore[operator]
             if (a := bfloat16.encode_one(t)) is not None]
    assert len(alone) == 20 and min(alone) > 0.999  # one at a time (no padding): the same up to rounding


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_products_have_their_kernels_built_at_load(dtype: str) -> None:
    # oneDNN builds a kernel the first time it meets a row count (~1 ms each, ~3 ms on an
    # embedding of a new length); its verbose log names each build "cache_miss". After loading,
    # texts of new lengths build none; a batch past one text's longest (3 x 102 rows) still does,
    # which shows the log would name them.
    probe = """
import ctypes, sys, torch
from services.cache.embedder import Embedder
libc, creation = ctypes.CDLL(None), torch.backends.mkldnn.VERBOSE_ON_CREATION
e = Embedder(threads=1, dtype=sys.argv[1])
print("PACKED", e.packed, flush=True)
with torch.backends.mkldnn.verbose(creation):
    for n in (3, 17, 45, 120, 250):
        assert e.encode_one(" ".join(["word"] * (n - 2))) is not None
libc.fflush(None)
print("BATCH", flush=True)
with torch.backends.mkldnn.verbose(creation):
    e.encode([" ".join(["word"] * 100)] * 3)
libc.fflush(None)
"""
    done = subprocess.run([sys.executable, "-c", probe, dtype], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    _, _, rest = done.stdout.partition("PACKED ")
    if not rest.startswith("True"):
        pytest.skip("the products are not packed here (no oneDNN in this torch build)")
    singles, _, batch = rest.partition("BATCH")

    def built(log: str) -> list[str]:
        return [line for line in log.splitlines() if "cache_miss" in line and "inner_product" in line]

    assert not built(singles), built(singles)[:3]
    assert built(batch)  # the log does name a build
