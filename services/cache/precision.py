"""Which dtype the cache's embedding model computes in: chosen by the machine unless the
``embedding_dtype`` setting names one. Pure Python: no torch, no numpy."""

from __future__ import annotations

from collections.abc import Set

from aiserve.common.cpu import machine_kind

AUTO = "auto"
DTYPES = ("float32", "bfloat16")
"""What ``embedding_dtype`` may name besides "auto"."""
_BF16_KINDS = {
    "amx": "amx: bf16 tile instructions",
    "avx512_bf16": "avx512_bf16: bf16 dot-product instructions",
}


def choose_dtype(device: str, cpu_flags: Set[str], setting: str) -> tuple[str, str]:
    """The dtype of the model's products on ``device`` with these CPU flags, and why: the
    setting where it names one, else bf16 where the CPU has bf16 instructions (the products of
    a prompt's few tokens are bound by reading the weights: bf16 halves the bytes, and the
    vectors move by at most 0.003 in cosine, changing no decision of the calibration set),
    float32 elsewhere (bf16 products would be emulated there) and on CUDA (not measured)."""
    if setting != AUTO:
        return setting, f"embedding_dtype={setting} set"
    kind = machine_kind(device, cpu_flags)
    if kind in _BF16_KINDS:
        return "bfloat16", f"{_BF16_KINDS[kind]}: oneDNN-packed bf16 products, half the bytes of float32 read"
    if kind == "cuda":
        return "float32", "cuda: float32 (bf16 measured on CPUs only)"
    return "float32", f"{kind}: no bf16 instructions (bf16 products would be emulated), float32"
