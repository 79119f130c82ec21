"""Fixtures shared by all tests: the real model from the model store (`make model` puts it there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiserve.common.paths import model_store_path
from aiserve.store import DEFAULT_MODEL_REF, Manifest, ModelRef, ModelStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def store() -> ModelStore:
    root = model_store_path()
    if not root.is_absolute():
        root = Path(__file__).resolve().parent.parent / root
    return ModelStore(root)


@pytest.fixture(scope="session")
def model_ref() -> ModelRef:
    return ModelRef.parse(DEFAULT_MODEL_REF)


@pytest.fixture(scope="session")
def model_dir(store: ModelStore, model_ref: ModelRef) -> Path:
    """The verified folder of the embedded default model (safetensors + tokenizer files)."""
    path, _ = store.load_path(model_ref)
    return path


@pytest.fixture(scope="session")
def manifest(store: ModelStore, model_ref: ModelRef) -> Manifest:
    return store.manifest(model_ref)
