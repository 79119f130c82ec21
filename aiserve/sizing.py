"""Memory sizing for a stored model: weights, KV cache, activations, recommended RAM.

Pure arithmetic from the version's ``config.json`` and its safetensors header (the parameter
count is read, not guessed). Figures are bytes.

- weights = parameters x bytes per parameter of the serving dtype (int4 counts half a byte,
  group scales not included);
- KV per token = 2 (K and V) x layers x KV heads x head dim x bytes of the KV dtype;
- KV at batch x context = KV per token x batch x context;
- activations of one decode step = batch x (f32 logits over the vocabulary + the hidden,
  attention and MLP buffers of one layer in the compute dtype);
- recommended RAM = twice the weights (loading holds a second copy while converting);
- largest batch: the batch whose KV and activations fit in ``memory`` after the weights;
- resident = what a serving inference process holds (its RSS): the runtime (``RUNTIME_BYTES``)
  + the weights + what loading leaves behind (``LOAD_OVERHEAD`` x the weights) + the KV cache
  with its prefix store (``prefix_fraction`` of the whole, as the service sizes it) + the
  activations; with ``wide`` (a 16-bit model on a CPU without bf16 instructions, which
  multiplies float32 copies of its weights) + the copies, twice the 16-bit weights' bytes; with
  ``packed`` (where the service multiplies oneDNN-packed weights: ``packs_weights``) + the
  packed copy (unless it is the float32 copy, already counted) + ``PACKED_KERNEL_BYTES``.
  Checked against the running service's RSS by tests/integration/test_sizing_rss.py (within
  15%; docs/quantization.md has the figures).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from aiserve.common.cpu import BF16_KINDS, machine_kind

RUNTIME_BYTES = 240 * 2**20
"""Resident memory of the inference process before it loads a model: Python, torch (218 MiB
for ``import torch`` alone, CPU build), grpc, prometheus_client and the service's own modules
(238 MiB measured for ``import services.inference.server``). tests/integration/test_sizing_rss.py
measures it again on the machine it runs on."""

LOAD_OVERHEAD = 0.2
"""Share of the weights' bytes that stays resident after loading: the loader fuses q/k/v and
gate/up into new tensors and frees the originals, and the C allocator keeps part of the freed
heap (float32 SmolLM2-135M: 616 MiB above the runtime after loading for 513 MiB of weights,
525 MiB after ``malloc_trim``)."""

PACKED_KERNEL_BYTES = 160 * 2**20
"""What oneDNN-packed serving holds beyond the packed copy of the weights: the primitives the
service builds at start for each weight shape at 48 row-count buckets
(aiserve/common/onednn.py), and their scratch. Measured: bfloat16 SmolLM2-135M at 4 x 512 held 1,035 MiB,
the unpacked estimate plus one more copy of the weights plus ~160 MiB."""

PREFIX_CACHE_FRACTION = 0.05
"""The inference service's default share of the KV cache kept for prompt prefixes
(``prefix_cache_fraction``): its slots are the other 95%."""

PREFIX_BLOCK_TOKENS = 16
"""Tokens per prefix block (the service's ``prefix_block_size``): the prefix store is whole blocks."""

DTYPE_BYTES = {"f32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "f16": 2.0,
               "float16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Shape:
    """What sizing needs from a model's config."""

    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Estimate:
    """One sizing answer, in bytes."""

    weights: int
    kv_per_token: int
    kv_total: int
    activations: int
    recommended_ram: int
    max_batch: int | None
    kv_cache: int
    """The KV cache as the inference service allocates it: the slots (kv_total) + the prefix store."""
    runtime: int
    resident: int

    def as_dict(self) -> dict[str, int | None]:
        return dict(self.__dict__)


def dtype_bytes(name: str) -> float:
    """Bytes per element of ``name``; ValueError naming the accepted ones otherwise."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


def safetensors_parameters(path: Path) -> int:
    """The number of parameters in a safetensors file, from its header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def shape_of(folder: Path) -> Shape:
    """The sizing shape of the model stored in ``folder``."""
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{folder} has no safetensors weights (a quantized version?): size its base "
                         f"version with --dtype int8 or int4")
    config = json.loads((folder / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return Shape(
        parameters=sum(safetensors_parameters(p) for p in weights),
        layers=int(config["num_hidden_layers"]),
        kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden=hidden,
        intermediate=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
    )


def estimate(shape: Shape, dtype: str, context: int, batch: int, kv_dtype: str | None = None,
             memory: int | None = None, prefix_fraction: float = PREFIX_CACHE_FRACTION,
             packed: bool = False, wide: bool = False) -> Estimate:
    """Size ``shape`` served in ``dtype`` at ``batch`` sequences of ``context`` tokens (one KV
    slot each, plus a prefix store of ``prefix_fraction`` of the whole KV cache); ``packed``:
    the service multiplies oneDNN-packed weights (``packs_weights``); ``wide``: it multiplies
    float32 copies of 16-bit weights (``keeps_float32_copies``), packed too where ``packed``."""
    if not 0.0 <= prefix_fraction < 1.0:
        raise ValueError(f"prefix_fraction must be in [0, 1), got {prefix_fraction}")
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be at least 1, got context={context} batch={batch}")
    weight_bytes = dtype_bytes(dtype)
    compute_bytes = 4.0 if weight_bytes >= 4 else 2.0
    weights = int(shape.parameters * weight_bytes)
    kv_per_token = int(2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes(kv_dtype or dtype))
    per_sequence_act = int(shape.vocab * 4 + (4 * shape.hidden + 2 * shape.intermediate) * compute_bytes)
    max_batch = None
    if memory is not None:
        free = memory - weights
        per_sequence = kv_per_token * context + per_sequence_act
        max_batch = max(0, free // per_sequence)
    kv_total = kv_per_token * context * batch
    prefix_share = int(kv_total * prefix_fraction / (1 - prefix_fraction))
    prefix_store = prefix_share // (PREFIX_BLOCK_TOKENS * kv_per_token) * PREFIX_BLOCK_TOKENS * kv_per_token
    kv_cache = kv_total + prefix_store
    resident = RUNTIME_BYTES + int(weights * (1 + LOAD_OVERHEAD)) + kv_cache + per_sequence_act * batch
    if wide:
        resident += int(shape.parameters * 4.0)  # every product's float32 copy (the tied lm_head's too)
    if packed:
        resident += (0 if wide else weights) + PACKED_KERNEL_BYTES  # a packed float32 copy replaces the copy
    return Estimate(weights=weights, kv_per_token=kv_per_token, kv_total=kv_total,
                    activations=per_sequence_act * batch, recommended_ram=2 * weights, max_batch=max_batch,
                    kv_cache=kv_cache, runtime=RUNTIME_BYTES, resident=resident)


_SIXTEEN_BIT = ("bf16", "bfloat16", "f16", "float16")


def keeps_float32_copies(dtype: str, cpu_flags: frozenset[str], device: str = "cpu") -> bool:
    """Whether the inference service multiplies float32 copies of weights served in ``dtype``
    on this machine, as its "auto" ``matmul_dtype`` does (services/inference/precision.py): a
    16-bit model on a CPU without bf16 instructions (AMX or AVX512_BF16), where bf16 products
    are emulated. ``cpu_flags`` as ``aiserve.common.cpu.read_cpu_flags`` gives them (an
    instruction-set cap in the environment drops the flags above it)."""
    return device == "cpu" and dtype in _SIXTEEN_BIT and machine_kind(device, cpu_flags) not in BF16_KINDS


def packs_weights(dtype: str, cpu_flags: frozenset[str], device: str = "cpu") -> bool:
    """Whether the inference service keeps oneDNN-packed weights served in ``dtype`` on this
    machine: float32 on any CPU (oneDNN's float32 products on packed weights, not MKL's), the
    float32 copies of a 16-bit model (``keeps_float32_copies``), and bfloat16 itself on a CPU
    with bf16 dot-product instructions, where the service's "auto" precision multiplies packed
    bf16 (docs/engine.md)."""
    if device != "cpu":
        return False
    return (dtype in ("f32", "float32") or keeps_float32_copies(dtype, cpu_flags, device)
            or (dtype in ("bf16", "bfloat16") and machine_kind(device, cpu_flags) in BF16_KINDS))
