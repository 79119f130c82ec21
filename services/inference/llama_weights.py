"""A Llama-family model's weights as the forward uses them: read from safetensors, fused
(q/k/v into one product, gate/up into one), on the device in the model dtype.

Each matrix product is a ``Linear``: the weight in the model dtype, plus a float32 copy where
the model runs its larger products wider (``matmul_dtype``), or a oneDNN-packed copy where
``aiserve.common.onednn.pack_checked`` gives one that computes ``F.linear``'s product; the
float32 copy is itself kept packed where it can be.

A quantized version (``aiserve models quantize``, services/inference/quantize.py) stores its
products already fused, under the names ``fused_products`` gives, as torchao tensor subclasses
in a ``torch.save`` file (``QUANTIZED_FILE``): those run on torchao's own ``F.linear`` kernels,
with neither a float32 copy nor packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from aiserve.common.huge_pages import HugePageArena
from aiserve.common.onednn import pack_checked, packed_linear
from services.inference.llama_config import LlamaConfig


@dataclass(frozen=True, slots=True)
class Linear:
    """``x @ w.T + b`` with ``w`` [out, in] in the model dtype; when the model has a wider matmul
    dtype, the float32 copies: ``w_wide``/``b_wide``, or ``b_wide`` and ``packed_wide``, the copy
    in oneDNN's layout (then ``w_wide`` is None: one copy is enough); and ``packed``, ``w`` in
    oneDNN's layout, where ``pack_checked`` gives one. ``gemv``: a product of at most
    ``GEMV_MAX_ROWS`` rows that is not ``wide`` runs on our op on ``w``
    (``torch.ops.aiserve.gemv``, csrc/gemv.cpp), which streams the weight from memory faster
    than oneDNN's kernel does at so few rows."""

    w: torch.Tensor
    b: torch.Tensor | None = None
    w_wide: torch.Tensor | None = None
    b_wide: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    packed_wide: torch.Tensor | None = None
    gemv: bool = False

    def __call__(self, x: torch.Tensor, wide: bool) -> torch.Tensor:
        """x [M, in] -> [M, out]; ``wide``: use the float32 copy if there is one."""
        if self.gemv and not wide and x.shape[0] <= GEMV_MAX_ROWS:
            return torch.ops.aiserve.gemv(x.contiguous(), self.w, self.b)
        if wide and self.packed_wide is not None:
            return packed_linear(x.to(torch.float32), self.packed_wide, self.b_wide).to(x.dtype)
        if wide and self.w_wide is not None:
            return F.linear(x.to(self.w_wide.dtype), self.w_wide, self.b_wide).to(x.dtype)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.b)
        return F.linear(x, self.w, self.b)

    def plan(self, wide: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The weight, bias and ``PRODUCT_MODES`` index ``__call__`` runs with for ``wide``, for
        the C++ layer loop (csrc/decode_layers.cpp), which makes the same choice's product."""
        if self.gemv and not wide:  # the layer loop's narrow steps: fewer rows than WIDE_MIN_ROWS
            return self.w, self.b, PRODUCT_MODES.index("gemv")
        if wide and self.packed_wide is not None:
            return self.packed_wide, self.b_wide, PRODUCT_MODES.index("wide_packed")
        if wide and self.w_wide is not None:
            return self.w_wide, self.b_wide, PRODUCT_MODES.index("wide")
        if self.packed is not None:
            return self.packed, self.b, PRODUCT_MODES.index("packed")
        return self.w, self.b, PRODUCT_MODES.index("plain")


PRODUCT_MODES = ("plain", "packed", "wide", "wide_packed", "gemv")
"""How a product runs, in csrc/decode_layers.cpp's numbering: F.linear on ``w``, oneDNN on
``packed``, F.linear on the float32 copy, oneDNN on the packed float32 copy, our op on ``w``."""

GEMV_MAX_ROWS = 4
"""The most rows ``torch.ops.aiserve.gemv`` takes (csrc/ops.h, kGemvMaxRows)."""


@dataclass(frozen=True, slots=True)
class Layer:
    """One decoder layer's weights."""

    ln_attn: torch.Tensor  # [hidden]
    qkv: Linear  # [(H + 2*KVH) * D, hidden]; bias for Qwen2
    o: Linear  # [hidden, H * D]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * I, hidden]
    down: Linear  # [hidden, I]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """Every weight of the model."""

    embed: torch.Tensor  # [V, hidden]
    lm_head: Linear  # [V, hidden]; shares ``embed`` when the embeddings are tied
    norm: torch.Tensor  # [hidden]
    layers: list[Layer]

    def linears(self) -> list[Linear]:
        """Every matrix product, the lm_head first."""
        return [self.lm_head, *(x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down))]


QUANTIZED_FILE = "model.quantized.pt"
"""A quantized version's weights: a ``torch.save`` state dict (safetensors refuses torchao's
tensor subclasses), read back with ``weights_only=True``."""


def fused_products(num_layers: int) -> list[tuple[str, list[str]]]:
    """(fused name, the names it concatenates along the output axis) of each product that the
    forward runs as one: what a quantized file stores fused, since torchao's tensors have no
    ``cat`` (per-row scales make quantizing the fused matrix equal to fusing the quantized rows)."""
    fused = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        fused.append((prefix + "self_attn.qkv_proj", [prefix + f"self_attn.{n}_proj" for n in "qkv"]))
        fused.append((prefix + "mlp.gate_up_proj", [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"]))
    return fused


def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a quantized tensor subclass (torchao's) rather than a plain tensor."""
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def quantized_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype a quantized model's tensors compute in (the dtype it was quantized from), or
    None when no tensor is quantized."""
    return next((t.dtype for t in tensors.values() if is_quantized(t)), None)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors in ``folder`` (and of its ``QUANTIZED_FILE``), on the
    CPU, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    if (folder / QUANTIZED_FILE).is_file():
        import torchao.quantization  # noqa: F401  registers its tensor types as safe to unpickle

        tensors.update(torch.load(folder / QUANTIZED_FILE, map_location="cpu", weights_only=True))
    return tensors


def build_weights(config: LlamaConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                  matmul_dtype: torch.dtype, pack_weights: bool, gemv: bool = False) -> LlamaWeights:
    """The model's weights from its named tensors (ValueError naming a missing one); ``gemv``:
    products of few rows on our op (``Linear.gemv``; its library loaded), a quantized one's not."""
    reader = _WeightReader(tensors, device, dtype, matmul_dtype, pack_weights, gemv)
    embed = reader.vector("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        lm_head = reader.tied_head(embed)
    else:
        lm_head = reader.linear(["lm_head"], bias=False)
    norm = reader.vector("model.norm.weight")
    return LlamaWeights(embed, lm_head, norm, [reader.layer(i) for i in range(config.num_layers)])


class _WeightReader:
    """Takes tensors by name, fuses and converts them; packs where ``pack_checked`` allows.

    Packing applies to the products in the model dtype or, where the model has a wider matmul
    dtype, to their float32 copies; after one weight fails the check, the rest are not tried.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 matmul_dtype: torch.dtype, pack_weights: bool, gemv: bool = False) -> None:
        self._tensors, self._device, self._dtype, self._matmul_dtype = tensors, device, dtype, matmul_dtype
        self._can_pack, self._gemv = pack_weights, gemv
        # On the CPU the weights sit one after another on 2 MiB pages where the kernel has them:
        # a step reads them all, and on 4 KiB pages that is ~65,000 TLB entries a step
        self._arena = HugePageArena() if torch.device(device).type == "cpu" else None

    def layer(self, i: int) -> Layer:
        """Decoder layer ``i``, its tensors read in the order of its fields."""
        prefix = f"model.layers.{i}."
        return Layer(
            self.vector(prefix + "input_layernorm.weight"),
            self.linear([prefix + f"self_attn.{n}_proj" for n in "qkv"], fused=prefix + "self_attn.qkv_proj"),
            self.linear([prefix + "self_attn.o_proj"]),
            self.vector(prefix + "post_attention_layernorm.weight"),
            self.linear([prefix + "mlp.gate_proj", prefix + "mlp.up_proj"], bias=False,
                        fused=prefix + "mlp.gate_up_proj"),
            self.linear([prefix + "mlp.down_proj"], bias=False),
        )

    def tied_head(self, embed: torch.Tensor) -> Linear:
        """The lm_head that shares the embedding (a packed copy is the layout's own buffer)."""
        if self._matmul_dtype != self._dtype:
            return self._wide(embed, None)
        return Linear(embed, None, None, packed=self._packed(embed, None), gemv=self._gemv)

    def linear(self, names: Sequence[str], bias: bool = True, fused: str | None = None) -> Linear:
        """The product of the named weights (and biases), concatenated along the output axis;
        a quantized weight (stored as ``fused`` where the names are several) runs as it is."""
        b = self._get(*[n + ".bias" for n in names]) if bias else None
        stored_fused = fused is not None and len(names) > 1 and fused + ".weight" in self._tensors
        w = self._get(f"{fused}.weight") if stored_fused else self._get(*[n + ".weight" for n in names])
        if w is None:
            raise ValueError(f"weights: {names[0]}.weight is missing")
        if is_quantized(w):
            return Linear(w, b)  # torchao's kernel: no float32 copy, no packing
        if self._matmul_dtype == self._dtype:
            return Linear(w, b, packed=self._packed(w, b), gemv=self._gemv)
        return self._wide(w, b)

    def vector(self, name: str) -> torch.Tensor:
        """The named tensor (a norm weight or the embedding)."""
        if (t := self._get(name)) is None:
            raise ValueError(f"weights: {name} is missing")
        return t

    def _get(self, *names: str) -> torch.Tensor | None:
        """The named tensors, concatenated, on the device in the model dtype (None if absent); a
        quantized tensor (always alone) is moved, keeping its own dtype."""
        if not all(n in self._tensors for n in names):
            return None
        if len(names) == 1 and is_quantized(t := self._tensors[names[0]]):
            return t.to(device=self._device)
        # a copy: never keep a buffer backed by the file mapping
        parts = [self._tensors[n] for n in names]
        if self._arena is not None:
            return self._arena.copy(parts[0] if len(parts) == 1 else torch.cat(parts), self._dtype)
        return torch.cat(parts).to(device=self._device, dtype=self._dtype, copy=True)

    def _wide(self, w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        """``w``'s product with its copies in the matmul dtype, the weight's packed where it can be."""
        w_wide, b_wide = w.to(self._matmul_dtype), None if b is None else b.to(self._matmul_dtype)
        if (packed := self._packed(w_wide, b_wide)) is not None:
            return Linear(w, b, None, b_wide, packed_wide=packed, gemv=self._gemv)
        return Linear(w, b, w_wide, b_wide, gemv=self._gemv)

    def _packed(self, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
        if not self._can_pack:
            return None
        if (p := pack_checked(w, b)) is None:
            self._can_pack = False
            return None
        return p
