"""The architecture facts of a Llama-family model (Llama, Mistral, Qwen2) that the forward needs.

Read from the model folder's config.json; the context length by the rule every service uses
(aiserve/model_facts.py). Also the rotary embedding's frequencies and tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from aiserve.model_facts import CONTEXT_KEYS, context_length

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The architecture facts of config.json that the forward needs."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope: dict[str, Any] = field(default_factory=dict)
    """rope_parameters / rope_scaling: "rope_type" ("default", "linear", "llama3") and its keys."""

    @property
    def num_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        """The facts of a parsed config.json; ValueError for a model type we do not run."""
        model_type = data.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        heads = int(data["num_attention_heads"])
        return cls(
            model_type=model_type,
            vocab_size=int(data["vocab_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_context_length(data),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            rope=rope,
        )


def _context_length(data: dict[str, Any]) -> int:
    """The context length by the rule every service uses (aiserve/model_facts.py)."""
    if (length := context_length(data)) is None:
        raise ValueError(f"config.json: none of {', '.join(CONTEXT_KEYS)} is set")
    return length


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32) as transformers computes them for the rope type."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = config.rope.get("rope_type", config.rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(config.rope["factor"])
    if kind == "llama3":
        factor, low, high = (float(config.rope[k]) for k in
                             ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(config.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type: {kind!r} is not supported (default, linear, llama3)")


def rope_tables(config: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [P, D] (float32, on ``device``) of every position, P = the context
    length. The sine carries rotate_half's sign ([-sin, sin] by halves), so the forward's
    rotation swaps the halves in one ``roll``."""
    angles = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
    angles = torch.cat((angles, angles), dim=-1)  # [P, D]
    sin = angles.sin()
    half = angles.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign, folded in
    return angles.cos().to(device), signed_sin.to(device)
