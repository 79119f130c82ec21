"""Weight quantization with torchao: a version's tensors -> the state dict of a quantized version.

Only the decoder layers' matrix products are quantized (q/k/v fused, o, gate/up fused, down):
the embedding, the norms, the biases and the lm_head stay in the compute dtype. The embedding
is a lookup (and, tied, also the lm_head), and the lm_head is the product whose error reaches
the logits unmixed. Products are fused before quantizing, as the forward runs them
(``llama_weights.fused_products``); with per-row (int8) or per-row-group (int4) scales this
equals quantizing each part. The kernels are torchao's: ``F.linear`` on its tensor subclasses.

Schemes on torch 2.13 / torchao 0.18 on CPU (docs/quantization.md):

- ``int8``: ``Int8WeightOnlyConfig`` (per-row int8, 1 byte per weight);
- ``int4``: ``IntxWeightOnlyConfig(int4, groups of 32, asymmetric)`` in its only CPU layout,
  ``unpacked_to_int8`` (int4 values held one per byte: int4's accuracy without its memory
  saving). ``Int4WeightOnlyConfig`` does not run on this CPU in any layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.inference.llama_weights import fused_products


@dataclass(frozen=True, slots=True)
class Scheme:
    """One way of quantizing the products: torchao's config for it, and what to record."""

    name: str
    config_name: str
    make_config: Callable[[], Any]
    note: str


def _int8_config() -> Any:
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


def _int4_config() -> Any:
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, PerGroup

    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP),  # type: ignore[attr-defined]
                                mapping_type=MappingType.ASYMMETRIC)


INT4_GROUP = 32
"""Weights per int4 scale: divides SmolLM2's hidden size (576), which 128 does not."""
SCHEMES = {
    "int8": Scheme("int8", "Int8WeightOnlyConfig()", _int8_config, "per-row int8 weights, bf16 activations"),
    "int4": Scheme("int4", f"IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup({INT4_GROUP}), "
                   "mapping_type=MappingType.ASYMMETRIC)", _int4_config,
                   "asymmetric int4 in groups of 32 along the input, held one value per byte (unpacked_to_int8)"),
}


def torchao_version() -> str:
    """The installed torchao's version (recorded in a quantized version's manifest)."""
    import torchao

    return str(torchao.__version__)


def quantize_weight(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``w`` [out, in] as torchao quantizes an ``nn.Linear`` holding it (a tensor subclass whose
    ``F.linear`` runs torchao's kernel)."""
    from torchao.quantization import quantize_

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
    linear.weight = torch.nn.Parameter(w, requires_grad=False)
    quantize_(linear, scheme.make_config())
    return linear.weight.detach()


def quantize_tensors(tensors: dict[str, torch.Tensor], num_layers: int, scheme: Scheme,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The quantized version's state dict: every tensor in ``dtype``, the layers' products fused
    and quantized (the fused ones under their fused names). ValueError when a product is missing."""
    out = {name: t.to(dtype) for name, t in tensors.items()}
    for fused, parts in fused_products(num_layers):
        weights = [out.pop(p + ".weight", None) for p in parts]
        if any(w is None for w in weights):
            raise ValueError(f"weights: a part of {fused} is missing")
        out[fused + ".weight"] = quantize_weight(torch.cat(weights), scheme)  # type: ignore[arg-type]
    for i in range(num_layers):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            if name not in out:
                raise ValueError(f"weights: {name} is missing")
            out[name] = quantize_weight(out[name], scheme)
    return out
