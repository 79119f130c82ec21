"""What Info reports about the loaded model, and the dtype names of the settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiserve.store import ModelRef
from services.inference.precision import Precision

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
    precision: Precision
    """The dtypes it runs in (``precision.weights`` is Info's ``dtype``) and why."""
    context_length: int
    """Tokens of prompt + output this engine accepts: min(model context, max_seq_len)."""
    vocab_size: int
    eos_token_ids: frozenset[int]
