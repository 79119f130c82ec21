"""all-MiniLM-L6-v2's sentence embedding, computed here: a BERT encoder over the package's own
safetensors and tokenizer.json, mean pooling over the tokens, L2 normalisation.

This is what sentence-transformers computes for this model (its modules.json: Transformer,
Pooling with mean tokens, Normalize), in the same float32 torch operations; the cache's tests
compare the two. In bfloat16 the products (the encoder's dense layers) run on bf16 weights,
packed for oneDNN where that is exact, with the embeddings, norms, attention and pooling
still in float32: the vectors move by at most 0.003 in cosine (tests/unit/cache/test_minilm.py).

Doing it here spares the service importing sentence-transformers and transformers (with
scikit-learn and scipy): ~2.5 CPU seconds at every start, on a 2-core machine where the
inference service loads its model at the same time (docs/decisions.md, decision 54).
Blocking and not thread-safe: ``embedder.Embedder`` serialises the calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from tokenizers import Tokenizer

from aiserve.common.onednn import build_kernels, pack_checked, packed_linear

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The few facts of config.json the encoder needs."""

    num_layers: int
    num_heads: int
    hidden_size: int
    layer_norm_eps: float

    @classmethod
    def read(cls, folder: Path) -> BertConfig:
        c = json.loads((folder / "config.json").read_text())
        if c.get("model_type") != "bert" or c.get("hidden_act") != "gelu":
            raise ValueError(f"{folder}: not a BERT model with gelu ({c.get('model_type')}, {c.get('hidden_act')})")
        return cls(c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"], c["layer_norm_eps"])


class MiniLM:
    """The encoder's weights (on ``device``; the dense layers' in ``dtype``) and tokenizer;
    ``encode`` gives unit vectors."""

    def __init__(self, folder: Path, weights: bytes, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        """``weights``: the bytes of ``folder``'s model.safetensors (the caller hashes them too)."""
        self.config = BertConfig.read(folder)
        pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
        if not pooling.get("pooling_mode_mean_tokens"):
            raise ValueError(f"{folder}: only mean pooling is implemented, got {pooling}")
        self.max_tokens = int(json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"])
        self.device = device
        self._w = {name: t.to(device) for name, t in load_safetensors(weights).items()}
        self._packed: dict[str, torch.Tensor] = {}
        """Dense layer name -> its weight packed for oneDNN (on a CPU, where ``pack_checked`` allows)."""
        for name in [n[: -len(".weight")] for n in self._w if n.startswith("encoder.") and n.endswith(".weight")
                     and self._w[n].dim() == 2]:
            w = self._w[name + ".weight"] = self._w[name + ".weight"].to(dtype)
            b = self._w[name + ".bias"] = self._w[name + ".bias"].to(dtype)
            if (packed := pack_checked(w, b)) is not None:
                self._packed[name] = packed
                del self._w[name + ".weight"]  # the packed copy replaces it: the weights' memory once
        self.packed = bool(self._packed)
        """Whether the dense layers run on packed weights."""
        if self._packed:
            # oneDNN builds a kernel per weight shape and row count the first time it meets them
            # (~1 ms each, ~3 ms on an embedding of a new length): build them now for every
            # bucketed row count one text can have, on one weight of each shape (the kernels
            # are the shape's, not the weight's).
            shapes = {packed.shape: (packed, self._w[name + ".bias"]) for name, packed in self._packed.items()}
            build_kernels(list(shapes.values()), self.max_tokens)
        self.dim = self.config.hidden_size
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_truncation()  # the package's file truncates to 128 and pads to 128
        self.tokenizer.no_padding()

    def num_tokens(self, text: str) -> int:
        """Word pieces of ``text`` including [CLS] and [SEP]."""
        return len(self.tokenizer.encode(text).ids)

    def encode(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit vectors [len(texts), dim] of texts of at most ``max_tokens`` word pieces each."""
        encodings = [self.tokenizer.encode(t.strip()) for t in texts]  # sentence-transformers strips
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(texts), width, dtype=torch.long)  # [B, T], 0 = [PAD]
        mask = torch.zeros(len(texts), width, dtype=torch.bool)  # [B, T]
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = torch.tensor(e.ids)
            mask[row, : len(e.ids)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            tokens = self._forward(ids, mask)  # [B, T, hidden]
            weights = mask.unsqueeze(-1).to(tokens.dtype)  # [B, T, 1]
            pooled = (tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # [B, hidden]
            return F.normalize(pooled, p=2, dim=1).cpu().numpy()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: [B, T] -> the last layer's hidden states [B, T, hidden]."""
        c, w = self.config, self._w
        e = "embeddings."
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][positions] \
            + w[e + "token_type_embeddings.weight"][0]  # [B, T, hidden]
        x = self._norm(x, e + "LayerNorm")
        keep = mask[:, None, None, :]  # [B, 1, 1, T]: padding is never attended to
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."
            attn = self._attention(x, keep, p + "attention.self.")
            x = self._norm(x + self._linear(attn, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = F.gelu(self._linear(x, p + "intermediate.dense"))  # [B, T, intermediate]
            x = self._norm(x + self._linear(h, p + "output.dense"), p + "output.LayerNorm")
        return x

    def _attention(self, x: torch.Tensor, keep: torch.Tensor, prefix: str) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden], every head attending over the unpadded tokens."""
        b, t, _ = x.shape
        heads = self.config.num_heads

        def split(name: str) -> torch.Tensor:  # [B, heads, T, head_dim]
            return self._linear(x, prefix + name).view(b, t, heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(split("query"), split("key"), split("value"), attn_mask=keep)
        return out.transpose(1, 2).reshape(b, t, -1)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x: [B, T, in] float32 -> [B, T, out] float32, the product in the weights' dtype."""
        b, packed = self._w[name + ".bias"], self._packed.get(name)
        if packed is None:
            w = self._w[name + ".weight"]
            return F.linear(x.to(w.dtype), w, b).to(x.dtype)
        rows = x.reshape(-1, x.shape[-1]).to(packed.dtype)  # [B*T, in]
        return packed_linear(rows, packed, b).to(x.dtype).view(*x.shape[:-1], -1)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self._w[name + ".weight"], self._w[name + ".bias"],
                            self.config.layer_norm_eps)
