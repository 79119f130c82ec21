"""CPU matrix products on oneDNN-packed bf16 weights, and the row-count buckets their kernels are
built for: the inference service's forward (which dtype its products run in is chosen in
services/inference/precision.py) and the cache's embedding model (services/cache/minilm.py).

``F.linear`` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every
call; a weight packed once at load runs the same kernel without that (docs/engine.md, "Packed
weights"). Only bf16 on a CPU with bf16 instructions is packed, and only where the packed
product equals ``F.linear`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 64  # oneDNN's layout hint; any row count runs on the packed weight
# Larger steps (a budget above this) build their few kernels when they first run: warming them
# would run products of gigabytes at start for a budget that is rarely used in full.
PREPARE_MAX_ROWS = 4096


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` [out, in] reordered once into oneDNN's blocked layout, or None where that is not
    available or not exact (only bf16 on a CPU with bf16 instructions is packed).

    ``F.linear`` on a bf16 CPU tensor runs the same oneDNN kernel but reorders the weight on
    every call; packed, a decode step's products run 1.3-2.8x faster (1 to 64 rows, measured
    on the 2-core VM) with bit-identical results, which ``packing_is_exact`` checks at load.
    """
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None


def pack_exact(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """``pack_weight(w)`` where its product equals ``F.linear`` bit for bit
    (``packing_is_exact``), else None: the weight to run packed, or run it unpacked."""
    packed = pack_weight(w)
    return packed if packed is not None and packing_is_exact(w, b, packed) else None


def bucket_rows(rows: int) -> int:
    """The row count a packed product runs with: ``rows`` up to 32, then rounded up to one of
    four steps per power of two (40, 48, 56, 64, 80, ...), so at most 25% more rows.

    oneDNN builds a kernel for each input shape (~1-1.5 ms, measured) and caches up to 1,024 of
    them; a step's row count is its number of new tokens, which varies from step to step.
    Unbucketed, serving kept building kernels, and the cache grew resident memory by ~350 MB
    over 2,000 soak requests (AMX VM, 2026-12-03). Bucketed, the default 512-token step budget
    needs 48 kernels per weight shape, all built at start (``prepare_kernels``).
    """
    if rows <= 32:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, in] @ the packed weight, run on ``bucket_rows(M)`` rows (zeros below ``x``)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, b, "none", [], "")


def packing_is_exact(w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """The packed product equals ``F.linear`` bit for bit on a few row counts."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 64):
        x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
        if not torch.equal(packed_linear(x, packed, b), F.linear(x, w, b)):
            return False
    return True


def kernel_buckets(max_rows: int) -> list[int]:
    """Every bucketed row count up to ``max_rows`` (at most ``PREPARE_MAX_ROWS``), ascending."""
    buckets, limit = [bucket_rows(1)], min(max_rows, PREPARE_MAX_ROWS)
    while buckets[-1] < limit:  # each bucket once, without walking every row count
        buckets.append(bucket_rows(buckets[-1] + 1))
    return buckets


def build_kernels(weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], max_rows: int) -> int:
    """Run each packed weight ``(w, packed, b)`` once at every bucket up to ``max_rows``, so
    oneDNN builds its kernels now and not while serving. Returns the number of products run."""
    buckets = kernel_buckets(max_rows)
    with torch.inference_mode():
        for w, packed, b in weights:
            for rows in buckets:
                packed_linear(w.new_zeros(rows, w.shape[1]), packed, b)
    return len(weights) * len(buckets)
