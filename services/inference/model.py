"""Load a verified model-store folder into a ready-to-run Hugging Face causal LM."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from aiserve.store import TOKENIZER_FILE, Manifest, ModelRef

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model in eval mode on its device, with the facts the engine and Info need."""

    ref: ModelRef
    model: PreTrainedModel
    device: torch.device
    dtype_name: str
    context_length: int
    """Maximum tokens of prompt + output (``max_position_embeddings``)."""
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer_sha256: str

    @property
    def device_name(self) -> str:
        return str(self.device)


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


def _own_memory(model: torch.nn.Module) -> None:
    """Copy every weight into ordinary (anonymous) memory.

    transformers reads safetensors through mmap, so float32 weights (no dtype conversion) stay
    backed by the file's page cache. On our VMs idle file pages get evicted and the next request
    faults every weight back in from disk: a server that slept crawls (DESIGN.md §6). Cloning
    drops the last reference to the mapped storage, so the mapping is released. Tied weights are
    one Parameter (``parameters()`` yields it once), so the tie survives.
    """
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()


def load_model(folder: Path, manifest: Manifest, device: str, dtype: str) -> LoadedModel:
    """Load the (already verified) store folder on ``device`` in ``dtype``, in eval mode."""
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=TORCH_DTYPES[dtype], local_files_only=True
    )
    if torch.device(device).type == "cpu":
        _own_memory(model)  # on an accelerator, .to(device) below copies off the mapping anyway
    torch.nn.Module.to(model, torch.device(device))  # in place (HF's own .to is oddly typed)
    model.eval()
    config = model.config
    return LoadedModel(
        ref=manifest.ref,
        model=model,
        device=torch.device(device),
        dtype_name=dtype,
        context_length=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size),
        eos_token_ids=eos_token_ids(folder),
        tokenizer_sha256=manifest.tokenizer_sha256,
    )
