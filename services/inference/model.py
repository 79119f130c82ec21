"""Facts of a verified model-store folder: its EOS ids and what Info reports about it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiserve.store import TOKENIZER_FILE, ModelRef

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What Info reports about the loaded model."""

    ref: ModelRef
    tokenizer_sha256: str
    device: str
    dtype: str
    context_length: int
    """Tokens of prompt + output this engine accepts: min(model context, max_seq_len)."""
    vocab_size: int
    eos_token_ids: frozenset[int]


def _ids(value: Any) -> set[int]:
    """An eos_token_id setting: absent, one id or a list of ids."""
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(folder: Path, token: str) -> int | None:
    """The id of ``token`` in tokenizer.json (added tokens first, then the model's vocabulary)."""
    data = _read_json(folder / TOKENIZER_FILE)
    for added in data.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = data.get("model", {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def eos_token_ids(folder: Path) -> frozenset[int]:
    """EOS ids of config.json, generation_config.json and the tokenizer's eos token, merged."""
    ids = _ids(_read_json(folder / "config.json").get("eos_token_id"))
    ids |= _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
    eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and (token_id := _token_id(folder, eos)) is not None:
        ids.add(token_id)
    return frozenset(ids)
