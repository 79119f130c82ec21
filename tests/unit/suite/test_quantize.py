"""``aiserve models quantize``: a new, verified, loadable version; the base version untouched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from aiserve.common.config import config_with
from aiserve.common.onednn import kernel_buckets
from aiserve.store import MANIFEST, ModelRef, ModelStore, ModelStoreError, sha256_file
from services.inference.config import InferenceConfig
from services.inference.engine_build import build_engine
from services.inference.llama import LlamaModel
from services.inference.llama_weights import QUANTIZED_FILE, is_quantized
from services.inference.offline import DecodeSpeed, OfflineModel
from suite.cli import build_parser
from suite.quantize import quantize_version, quantized_ref, speed_verdict
from tests.unit.suite.tiny_versions import tiny_version


def folder_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_writes_a_new_loadable_version_and_leaves_the_base_alone(
        scheme: str, tmp_path: Path, model_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    base = tiny_version(store, model_dir, tmp_path)
    before = folder_hashes(store.path(base))
    manifest = quantize_version(store, base, scheme)

    assert manifest.ref == quantized_ref(base, scheme) and manifest.ref.version == f"1-{scheme}"
    assert manifest.quantization is not None and manifest.quantization["scheme"] == scheme
    assert manifest.quantization["base"] == "tiny@1" and "torchao" in manifest.quantization["library"]
    assert QUANTIZED_FILE in manifest.files and not any(n.endswith(".safetensors") for n in manifest.files)
    assert store.verify(manifest.ref).quantization == manifest.quantization  # hashes written and read back
    assert folder_hashes(store.path(base)) == before  # every base file, its manifest included
    assert store.verify(base).quantization is None

    quantized = LlamaModel.load(store.path(manifest.ref), "cpu", torch.float32)  # runs in its own dtype
    plain = LlamaModel.load(store.path(base), "cpu", torch.bfloat16, torch.bfloat16)
    assert quantized.dtype == quantized.matmul_dtype == torch.bfloat16
    for layer in quantized.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert is_quantized(linear.w) and linear.packed is None and linear.w_wide is None
    assert not quantized.packed_weights and not is_quantized(quantized.lm_head.w)
    ids = list(range(100, 164))
    q_logits, p_logits = OfflineModel(quantized).text_logits(ids), OfflineModel(plain).text_logits(ids)
    # Quantized, not broken: a broken model agrees with ~1 in 49,152 (int4's 16 levels err more on
    # random weights than on trained ones)
    assert (q_logits.argmax(-1) == p_logits.argmax(-1)).float().mean() > {"int8": 0.9, "int4": 0.5}[scheme]
    assert not torch.equal(q_logits, p_logits)  # and really quantized


def test_quantize_refuses_an_existing_target_and_a_quantized_base(tmp_path: Path, model_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    base = tiny_version(store, model_dir, tmp_path)
    first = quantize_version(store, base, "int8")
    with pytest.raises(ModelStoreError, match="already in the store"):
        quantize_version(store, base, "int8")
    with pytest.raises(ModelStoreError, match="already quantized"):
        quantize_version(store, first.ref, "int8")
    again = quantize_version(store, base, "int8", force=True)
    assert (store.path(again.ref) / MANIFEST).is_file() and store.verify(again.ref).files == first.files


def test_a_tampered_quantized_file_is_refused(tmp_path: Path, model_dir: Path) -> None:
    store = ModelStore(tmp_path / "store")
    manifest = quantize_version(store, tiny_version(store, model_dir, tmp_path), "int8")
    with (store.path(manifest.ref) / QUANTIZED_FILE).open("ab") as f:
        f.write(b"x")
    with pytest.raises(ModelStoreError, match=f"{QUANTIZED_FILE} does not match its manifest"):
        store.verify(manifest.ref)


def test_the_speed_verdict_says_when_the_scheme_is_slower() -> None:
    slow = speed_verdict("int8", DecodeSpeed(16, 2.0), DecodeSpeed(16, 0.5))
    assert slow.startswith("int8 is SLOWER than the base") and "8.0 tok/s" in slow and "32.0 tok/s" in slow
    assert "0.25x" in slow and "1 torch thread)" in slow
    assert "not slower" in speed_verdict("int8", DecodeSpeed(16, 0.5), DecodeSpeed(16, 0.5))


def test_the_command_quantizes_and_reports_both_speeds(tmp_path: Path, model_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    store = ModelStore(tmp_path / "store")
    tiny_version(store, model_dir, tmp_path)
    args = build_parser().parse_args(["models", "quantize", "tiny@1", "--scheme", "int8", "--store", str(store.root)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "wrote tiny@1-int8" in out and "files hashed" in out
    assert re.search(r"int8: [\d.]+ tok/s, base: [\d.]+ tok/s \([\d.]+x; greedy decode of 16 tokens, batch 1, "
                     r"1 torch thread\)", out), out
    assert store.verify(quantized_ref(ModelRef("tiny", "1"), "int8")).quantization is not None
    usage = build_parser().parse_args(["models", "quantize", "tiny@1", "--store", str(store.root)])
    assert usage.func(usage) == 2  # no --scheme
    listing = build_parser().parse_args(["models", "list", "--store", str(store.root)])
    assert listing.func(listing) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("\tint8 of tiny@1")


def test_the_service_builds_its_engine_on_a_quantized_version(tmp_path: Path, model_dir: Path) -> None:
    """What ``AISERVE_INFERENCE_MODEL=...-int8`` loads: the service's own build path, float32
    asked for and bfloat16 run (the dtype it was quantized in), no packing of the products."""
    store = ModelStore(tmp_path / "store")
    manifest = quantize_version(store, tiny_version(store, model_dir, tmp_path), "int8")
    config = config_with(InferenceConfig, dtype="float32", max_num_seqs=1, max_seq_len=64)
    engine = build_engine(config, store.path(manifest.ref))
    assert engine.model.dtype == engine.model.matmul_dtype == torch.bfloat16
    assert is_quantized(engine.model.layers[0].gate_up.w) and engine.model.layers[0].gate_up.packed is None
    assert engine.model.prepare_kernels(64) in (0, len(kernel_buckets(64)))  # the bf16 lm_head's, if packed
